"""Llama and OLMo 2 (transformers' `LlamaForCausalLM`, `Olmo2ForCausalLM`) as
a LoopedTransformer.

A feedforward Llama of n layers is the looped model with every layer in the
core, applied once (R = 1, no injection): the baseline MECH compares looped
models against. `split=(p, c, k)` places its layers as prelude, core and coda
instead (the layout retrofitted recurrence starts from), the core applied
`num_loops` times; at R = 1 that is the same function. With p + c + k < n the
layers between prelude and core are dropped: the prelude is the first p, the
coda the last k, the core the c before the coda (retrofitting's TinyLlama
4,8,4 of 22 keeps layers 0-3, 10-17, 18-21).

The mapping, by name: q/k/v/o projections (out, in) -> wq (D, N, H), wkv (D,
2, K, H) (one fused wqkv (D, 3, N, H) when K = N), wo (N, H, D); gate and up
-> w_in (D, 2, F); down -> w_out (F, D); input / post-attention norms -> norm1
/ norm2; the final norm; lm_head -> unembed, or the embedding where tied.
Llama's rotary embedding rotates dimension i with i + H/2 (`rope_pairing`
"half"), so no per-head permutation is needed; Llama 3.1 / 3.2's rescaling
(rope_scaling in 4.x, rope_parameters in 5.x: `hf_dir.rope`) is `rope_llama3`.
OLMo 2 differs in two places (`LAYOUTS`): each sublayer's output is normalized
before it joins the residual stream, with no input norm (`norm_position`
"res_post": post-attention / post-feedforward norms -> norm1 / norm2), and
queries and keys are normalized across heads before RoPE (`qk_norm`: q_norm /
k_norm).
"""

import ml_collections
import numpy as np

from loopjax.errors import ConfigError
from loopjax.field_rules import llama3_ok
from loopjax.pretrained.hf_dir import check_config, rope

# model_type -> (architecture, norm_position, the two norms' names, qk_norm,
# the defaults of transformers' LlamaConfig / Olmo2Config (4.57 and 5.x agree)
# for fields config.json may leave out)
LAYOUTS = {
  "llama": (
    "LlamaForCausalLM",
    "pre",
    ("input_layernorm", "post_attention_layernorm"),
    False,
    dict(rms_norm_eps=1e-6, rope_theta=10_000.0, max_position_embeddings=2048),
  ),
  "olmo2": (
    "Olmo2ForCausalLM",
    "res_post",
    ("post_attention_layernorm", "post_feedforward_layernorm"),
    True,
    dict(rms_norm_eps=1e-5, rope_theta=10_000.0, max_position_embeddings=2048),
  ),
}
# config.json fields loopjax's Llama reads as these values only.
FIXED = {
  "hidden_act": "silu",
  "attention_bias": False,
  "mlp_bias": False,
  "pretraining_tp": 1,
}


def rope_llama3(scaling, max_len: int) -> tuple:
  """`rope_llama3` from a llama3 rescaling dict (`hf_dir.rope`'s; None: no
  rescaling); its pretraining context defaults to the model's `max_len`, as
  transformers 5 standardizes it."""
  if scaling is None:
    return ()
  keys = ("factor", "low_freq_factor", "high_freq_factor")
  if missing := [k for k in keys if k not in scaling]:
    raise ConfigError(
      f"config.json: rope_parameters of rope_type 'llama3' lacks {missing[0]}"
    )
  out = (
    *(float(scaling[k]) for k in keys),
    int(scaling.get("original_max_position_embeddings", max_len)),
  )
  if not llama3_ok(out):  # model.rope_llama3's own rule
    raise ConfigError(
      "config.json: rope_parameters llama3 needs factor >= 1, 0 < "
      f"low_freq_factor < high_freq_factor and a positive context; got {out}"
    )
  return out


def swiglu_rope(
  hf: dict, D: int, N: int, names: tuple, max_len: int, default_theta=10_000.0
) -> dict:
  """The `model` fields of a Llama-style block in config.json `hf` (d_model
  D and N heads under `names`, `max_len` positions): grouped-query attention,
  a SwiGLU MLP, RMSNorm, rotate-half RoPE (`hf_dir.rope`: its base, or
  `default_theta` where none is written) with Llama 3's rescaling where its
  rope_type says."""
  theta, scaling = rope(hf, default_theta)
  K = hf.get("num_key_value_heads") or N
  if (hf.get("head_dim") or D // N) * N != D:  # 5.x may write null
    raise ConfigError(
      f"config.json: head_dim must be {names[0]} / {names[1]} ({D // N}); "
      f"got {hf['head_dim']}"
    )
  return dict(
    d_model=D,
    num_heads=N,
    num_kv_heads=0 if K == N else K,
    mlp_type="swiglu",
    mlp_hidden=hf["intermediate_size"],
    norm_type="rmsnorm",
    pos_encoding="rope",
    rope_pairing="half",
    rope_theta=theta,
    rope_llama3=rope_llama3(scaling, max_len),
  )


def decoder_config(hf: dict, base, architecture: str, fixed: dict, defaults: dict):
  """(loopjax `model` config, vocab size, max length) of a Llama-style
  decoder's config.json `hf` (Llama, OLMo 2, Ouro): its shapes, RoPE and norms,
  every layer in the core, applied once, from `base` (a `model` section).
  `defaults`: the values transformers' config class of this model type takes
  for fields config.json leaves out (rms_norm_eps, rope_theta,
  max_position_embeddings)."""
  check_config(hf, architecture, fixed)
  D, N = hf["hidden_size"], hf["num_attention_heads"]
  max_len = hf.get("max_position_embeddings", defaults["max_position_embeddings"])
  names = ("hidden_size", "num_attention_heads")
  cfg = ml_collections.ConfigDict(base.to_dict())
  cfg.update(
    swiglu_rope(hf, D, N, names, max_len, defaults["rope_theta"]),
    qk_norm=False,
    norm_eps=float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
    embed_scale=1.0,
    num_prelude=0,
    num_layers=hf["num_hidden_layers"],
    num_coda=0,
    num_loops=1,
    injection="none",
    init_state="embedding",
    state_norm=False,
    exit_gate=False,
    coda_norm=False,
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
  )
  return cfg, hf["vocab_size"], max_len


def model_config(hf: dict, base, split=None, num_loops: int | None = None):
  """(loopjax `model` config, vocab size, max length) for config.json `hf`,
  from `base` (a `model` section)."""
  want, norm_position, _, qk_norm, defaults = LAYOUTS[hf["model_type"]]
  cfg, vocab_size, max_len = decoder_config(hf, base, want, FIXED, defaults)
  n = cfg.num_layers
  p, c, k = split or (0, n, 0)
  if p + c + k > n or c < 1 or min(p, k) < 0:
    raise ConfigError(
      f"model.hf_split: prelude, core and coda layers must fit in the model's "
      f"{n} layers (at most {n} in all) with a core of at least 1; got {p},{c},{k}"
    )
  cfg.update(
    norm_position=norm_position,
    qk_norm=qk_norm,
    num_prelude=p,
    num_layers=c,
    num_coda=k,
    num_loops=num_loops or 1,
  )
  return cfg, vocab_size, max_len


def attention(hf_dir, cfg, q_DQ, k_DQ, v_DQ, o_QD, norms_at: str) -> dict:
  """loopjax's attention params from (in, out) projections: one fused wqkv
  (D, 3, N, H) when K = N, else wq (D, N, H) and wkv (D, 2, K, H); wo (N, H,
  D); the q / k norms under `norms_at` where `qk_norm` (OLMo 2's)."""
  D, N = cfg.d_model, cfg.num_heads
  K, H = cfg.num_kv_heads or N, D // N
  q, k, v = q_DQ.reshape(D, N, H), k_DQ.reshape(D, K, H), v_DQ.reshape(D, K, H)
  attn = {"wo": o_QD.reshape(N, H, D), "bo": hf_dir.zeros(D)}
  if cfg.qk_norm:
    attn["q_norm"] = {"scale": hf_dir.take(norms_at + "q_norm.weight", (N * H,))}
    attn["k_norm"] = {"scale": hf_dir.take(norms_at + "k_norm.weight", (K * H,))}
  if K == N:
    return attn | {"wqkv": np.stack([q, k, v], 1), "bqkv": hf_dir.zeros(3, N, H)}
  return attn | {"wq": q, "wkv": np.stack([k, v], 1)}


def attention_mlp(hf_dir, cfg, at: str) -> dict:
  """A Llama-style layer's attention and SwiGLU params from the tensors under
  `at` ("model.layers.i."): q/k/v/o and gate/up/down projections, OLMo 2's
  q/k norms where `qk_norm`. Llama, OLMo 2 and Ouro name them alike."""
  D, N = cfg.d_model, cfg.num_heads
  K, H, F = cfg.num_kv_heads or N, D // N, cfg.mlp_hidden
  get = hf_dir.take
  q_DQ = get(at + "self_attn.q_proj.weight", (N * H, D)).T
  k_DQ = get(at + "self_attn.k_proj.weight", (K * H, D)).T
  v_DQ = get(at + "self_attn.v_proj.weight", (K * H, D)).T
  o_QD = get(at + "self_attn.o_proj.weight", (D, N * H)).T
  attn = attention(hf_dir, cfg, q_DQ, k_DQ, v_DQ, o_QD, at + "self_attn.")
  gate = get(at + "mlp.gate_proj.weight", (F, D)).T
  up = get(at + "mlp.up_proj.weight", (F, D)).T
  return {
    "attn": attn,
    "mlp": {
      "w_in": np.stack([gate, up], 1),
      "w_out": get(at + "mlp.down_proj.weight", (D, F)).T,
    },
  }


def embed_and_head(hf_dir, cfg, vocab_size: int) -> dict:
  """The embedding, the final norm and an untied head (Llama's names)."""
  D = cfg.d_model
  out = {
    "embed": hf_dir.take("model.embed_tokens.weight", (vocab_size, D)),
    "norm": {"scale": hf_dir.take("model.norm.weight", (D,))},
  }
  if not cfg.tie_embeddings:
    out["unembed"] = hf_dir.take("lm_head.weight", (vocab_size, D)).T
  return out


def params(hf_dir, cfg, vocab_size: int) -> dict:
  """The LoopedTransformer's params (a pure dict, in `hf_dir.dtype`) from
  `hf_dir`'s tensors."""
  norms = LAYOUTS[hf_dir.config["model_type"]][2]

  def layer(i):
    at = f"model.layers.{i}."
    scale = lambda name: {"scale": hf_dir.take(at + f"{name}.weight", (cfg.d_model,))}  # noqa: E731
    return attention_mlp(hf_dir, cfg, at) | {
      "norm1": scale(norms[0]),
      "norm2": scale(norms[1]),
    }

  p, c, k = cfg.num_prelude, cfg.num_layers, cfg.num_coda
  n = hf_dir.config["num_hidden_layers"]
  for i in range(p, n - k - c):  # dropped: the layers between prelude and core
    for name in hf_dir.files:
      if name.startswith(f"model.layers.{i}."):
        hf_dir.skip(name)
  groups = {
    "prelude": [layer(i) for i in range(p)],
    "core": [layer(i) for i in range(n - k - c, n - k)],
    "coda": [layer(i) for i in range(n - k, n)],
  }
  return embed_and_head(hf_dir, cfg, vocab_size) | {
    g: dict(enumerate(ls))
    for g, ls in groups.items()
    if ls  # empty: no state
  }
