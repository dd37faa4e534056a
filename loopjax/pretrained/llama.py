"""Llama and OLMo 2 (transformers' `LlamaForCausalLM`, `Olmo2ForCausalLM`) as
a LoopedTransformer.

A feedforward Llama of n layers is the looped model with every layer in the
core, applied once (R = 1, no injection): the baseline MECH compares looped
models against. `split=(p, c, k)` places its layers as prelude, core and coda
instead (the layout retrofitted recurrence starts from), the core applied
`num_loops` times; at R = 1 that is the same function.

The mapping, by name: q/k/v/o projections (out, in) -> wq (D, N, H), wkv (D,
2, K, H) (one fused wqkv (D, 3, N, H) when K = N), wo (N, H, D); gate and up
-> w_in (D, 2, F); down -> w_out (F, D); input / post-attention norms -> norm1
/ norm2; the final norm; lm_head -> unembed, or the embedding where tied.
Llama's rotary embedding rotates dimension i with i + H/2 (`rope_pairing`
"half"), so no per-head permutation is needed. OLMo 2 differs in two places
(`LAYOUTS`): each sublayer's output is normalized before it joins the residual
stream, with no input norm (`norm_position` "res_post": post-attention /
post-feedforward norms -> norm1 / norm2), and queries and keys are normalized
across heads before RoPE (`qk_norm`: q_norm / k_norm).
"""

import ml_collections
import numpy as np

from loopjax.errors import ConfigError
from loopjax.pretrained.hf_dir import check_config

# model_type -> (architecture, norm_position, the two norms' names, qk_norm)
LAYOUTS = {
  "llama": (
    "LlamaForCausalLM",
    "pre",
    ("input_layernorm", "post_attention_layernorm"),
    False,
  ),
  "olmo2": (
    "Olmo2ForCausalLM",
    "res_post",
    ("post_attention_layernorm", "post_feedforward_layernorm"),
    True,
  ),
}
# config.json fields loopjax's Llama reads as these values only.
FIXED = {
  "hidden_act": "silu",
  "attention_bias": False,
  "mlp_bias": False,
  "rope_scaling": None,
  "pretraining_tp": 1,
}


def model_config(hf: dict, base, split=None, num_loops: int | None = None):
  """(loopjax `model` config, vocab size, max length) for config.json `hf`,
  from `base` (a `model` section)."""
  want, norm_position, _, qk_norm = LAYOUTS[hf["model_type"]]
  check_config(hf, want, FIXED)
  D, N = hf["hidden_size"], hf["num_attention_heads"]
  K = hf.get("num_key_value_heads") or N
  if hf.get("head_dim", D // N) * N != D:
    raise ConfigError(
      f"config.json: head_dim must be hidden_size / num_attention_heads "
      f"({D // N}); got {hf['head_dim']}"
    )
  n = hf["num_hidden_layers"]
  p, c, k = split or (0, n, 0)
  if p + c + k != n or c < 1:
    raise ConfigError(
      f"model.hf_split: prelude, core and coda layers must add up to the "
      f"model's {n} layers with a core of at least 1; got {p},{c},{k}"
    )
  cfg = ml_collections.ConfigDict(base.to_dict())
  cfg.update(
    d_model=D,
    num_heads=N,
    num_kv_heads=0 if K == N else K,
    mlp_type="swiglu",
    mlp_hidden=hf["intermediate_size"],
    norm_type="rmsnorm",
    norm_position=norm_position,
    qk_norm=qk_norm,
    norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    pos_encoding="rope",
    rope_theta=float(hf.get("rope_theta", 10_000.0)),
    rope_pairing="half",
    embed_scale=1.0,
    num_prelude=p,
    num_layers=c,
    num_coda=k,
    num_loops=num_loops or 1,
    injection="none",
    init_state="embedding",
    state_norm=False,
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
  )
  return cfg, hf["vocab_size"], hf.get("max_position_embeddings", 2048)


def params(hf_dir, cfg, vocab_size: int) -> dict:
  """The LoopedTransformer's params (a pure dict, in `hf_dir.dtype`) from
  `hf_dir`'s tensors."""
  norms = LAYOUTS[hf_dir.config["model_type"]][2]
  D, N = cfg.d_model, cfg.num_heads
  K, H, F = cfg.num_kv_heads or N, D // N, cfg.mlp_hidden
  get = hf_dir.take

  def layer(i):
    at = f"model.layers.{i}."
    q = get(at + "self_attn.q_proj.weight", (N * H, D)).T.reshape(D, N, H)
    k = get(at + "self_attn.k_proj.weight", (K * H, D)).T.reshape(D, K, H)
    v = get(at + "self_attn.v_proj.weight", (K * H, D)).T.reshape(D, K, H)
    o = get(at + "self_attn.o_proj.weight", (D, N * H)).T.reshape(N, H, D)
    attn = {"wo": o, "bo": hf_dir.zeros(D)}
    if cfg.qk_norm:
      attn["q_norm"] = {"scale": get(at + "self_attn.q_norm.weight", (N * H,))}
      attn["k_norm"] = {"scale": get(at + "self_attn.k_norm.weight", (K * H,))}
    if K == N:
      attn |= {"wqkv": np.stack([q, k, v], 1), "bqkv": hf_dir.zeros(3, N, H)}
    else:
      attn |= {"wq": q, "wkv": np.stack([k, v], 1)}
    gate = get(at + "mlp.gate_proj.weight", (F, D)).T
    up = get(at + "mlp.up_proj.weight", (F, D)).T
    return {
      "attn": attn,
      "mlp": {
        "w_in": np.stack([gate, up], 1),
        "w_out": get(at + "mlp.down_proj.weight", (D, F)).T,
      },
      "norm1": {"scale": get(at + f"{norms[0]}.weight", (D,))},
      "norm2": {"scale": get(at + f"{norms[1]}.weight", (D,))},
    }

  layers = [layer(i) for i in range(cfg.num_prelude + cfg.num_layers + cfg.num_coda)]
  p, c = cfg.num_prelude, cfg.num_layers
  groups = {"prelude": layers[:p], "core": layers[p : p + c], "coda": layers[p + c :]}
  out = {
    "embed": get("model.embed_tokens.weight", (vocab_size, D)),
    "norm": {"scale": get("model.norm.weight", (D,))},
  } | {g: dict(enumerate(ls)) for g, ls in groups.items() if ls}  # empty: no state
  if not cfg.tie_embeddings:
    out["unembed"] = get("lm_head.weight", (vocab_size, D)).T
  return out
