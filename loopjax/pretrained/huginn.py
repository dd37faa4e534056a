"""Huginn-0125 (Geiping et al. 2025; `RavenForCausalLM`, model_type
huginn_raven) as a LoopedTransformer.

Its layout is loopjax's own: a prelude, a recurrent core and a coda of
"sandwich" blocks, each sublayer pre-normed and the residual stream
normalized after each add (`norm_position` "residual": norm_1..norm_4 ->
norm1, norm1_out, norm2, norm2_out); every iteration starts from a linear
adapter of concat(state, prelude output) (`injection` concat, no bias); the
first state is a truncated normal of std sqrt(2 / 5d) times the embedding
scale sqrt(d) (`init_state` trunc_normal); the final norm is applied to the
last state before the coda and again after it (`coda_norm`); RoPE rotates
dimensions (2i, 2i + 1) (`rope_pairing` interleaved, base `rope_base`); the
fused Wqkv (q, k, v stacked on the output axis) -> wqkv, its learned q / k
bias -> bqkv (no v bias); the gate and up halves of mlp.fc -> w_in; tied head.
"""

import math

import ml_collections
import numpy as np

from loopjax.errors import ConfigError
from loopjax.pretrained.hf_dir import check_config, rope

MODEL_TYPE = "huginn_raven"  # also the retrofitted models' (retrofit.family)
ARCHITECTURE = "RavenForCausalLM"
FIXED = {"bias": False, "injection_type": "linear", "tie_embeddings": True,
         "block_class_name": "SandwichBlock", "mlp_class_name": "GatedMLP",
         "test_time_noise": 0}  # fmt: skip


def model_config(hf: dict, base, split=None, num_loops: int | None = None):
  """(loopjax `model` config, vocab size, max length); `num_loops` defaults
  to the trained mean recurrence. Huginn has its own layer split."""
  check_config(hf, ARCHITECTURE, FIXED)
  if split is not None:
    raise ConfigError("model.hf_split: Huginn's prelude, core and coda are its own")
  D, N = hf["n_embd"], hf["n_heads"]
  if hf.get("num_key_value_heads", N) != N:
    raise ConfigError(
      f"config.json: num_key_value_heads must be n_heads ({N}); "
      f"got {hf['num_key_value_heads']}"
    )
  cfg = ml_collections.ConfigDict(base.to_dict())
  cfg.update(
    d_model=D,
    num_heads=N,
    num_kv_heads=0,
    mlp_type="swiglu",
    mlp_hidden=hf["intermediate_size"],
    norm_type="rmsnorm",
    norm_position="residual",
    norm_eps=float(hf.get("norm_eps", 1e-6)),
    qk_norm=False,
    pos_encoding="rope",
    rope_theta=rope_base(hf),
    rope_pairing="interleaved",
    embed_scale=math.sqrt(D),
    num_prelude=hf["n_layers_in_prelude"],
    num_layers=hf["n_layers_in_recurrent_block"],
    num_coda=hf["n_layers_in_coda"],
    num_loops=num_loops or hf["mean_recurrence"],
    injection="concat",
    init_state="trunc_normal",
    init_state_std=math.sqrt(2 / (5 * D)) * math.sqrt(D),
    coda_norm=True,
    exit_gate=False,
    rope_llama3=(),
    state_norm=False,
    tie_embeddings=True,
  )
  vocab = hf.get("padded_vocab_size", hf["vocab_size"])
  return cfg, vocab, hf.get("block_size", 4096)


def owns(hf: dict, names: set) -> bool:
  """Whether a huginn_raven directory holds Huginn-0125 itself, not a model
  retrofitted into its layout: by its tensors `names`, four norms a block
  (norm_4); by config.json `hf` alone (no tensors: a shape), its blocks' q / k
  bias (qk_bias, its config class's default true) and no rope_theta: the
  converters write qk_bias false and rope_theta (the base Llama reads), which
  Huginn's class never sets."""
  if names:
    return any(n.endswith(".norm_4.weight") for n in names)
  return bool(hf.get("qk_bias", True)) and "rope_theta" not in hf


def rope_base(hf: dict) -> float:
  """RoPE's base: rope_base (its config class's default 50,000), or the same
  value under rope_parameters; no rescaling. transformers 5 saves Huginn's
  config as 4.x did (its class sets no RoPE attribute for 5.x to move:
  tests/fixtures/hf/huginn/config_v5.json), but a config rewritten by other
  tools may carry rope_parameters, so both places are read."""
  theta, scaling = rope(hf, 50_000.0, theta_key="rope_base")
  if scaling is not None:
    raise ConfigError(
      "config.json: Huginn's RoPE has no rescaling; got rope_type 'llama3'"
    )
  return theta


def params(hf_dir, cfg, vocab_size: int) -> dict:
  """The LoopedTransformer's params (a pure dict, in `hf_dir.dtype`) from
  `hf_dir`'s tensors."""
  D, N, F = cfg.d_model, cfg.num_heads, cfg.mlp_hidden
  H, get = D // N, hf_dir.take

  def block(at):
    wqkv = get(at + "attn.Wqkv.weight", (3 * D, D)).T.reshape(D, 3, N, H)
    qk = get(at + "attn.qk_bias", (2, 1, N, H))[:, 0]
    norms = [{"scale": get(at + f"norm_{i}.weight", (D,))} for i in range(1, 5)]
    return {
      "attn": {
        "wqkv": wqkv,
        "bqkv": np.concatenate([qk, hf_dir.zeros(1, N, H)]),
        "wo": get(at + "attn.proj.weight", (D, D)).T.reshape(N, H, D),
        "bo": hf_dir.zeros(D),
      },
      "mlp": {
        "w_in": get(at + "mlp.fc.weight", (2 * F, D)).T.reshape(D, 2, F),
        "w_out": get(at + "mlp.proj.weight", (D, F)).T,
      },
      **dict(zip(("norm1", "norm1_out", "norm2", "norm2_out"), norms, strict=True)),
    }

  out = raven_params(hf_dir, cfg, vocab_size, block)
  hf_dir.skip("freqs_cis")  # the RoPE table, recomputed
  if "lm_head.weight" in hf_dir.files:  # tied: stored by some exports too
    hf_dir.skip("lm_head.weight")
  return out


def raven_params(hf_dir, cfg, vocab_size: int, block) -> dict:
  """The params of Raven's layout (Huginn's and the retrofitted models'):
  embedding, final norm, adapter, and prelude / core / coda of `block(at)`,
  one block's params from the tensors under `at`."""
  D, get = cfg.d_model, hf_dir.take

  def group(name, n):
    return {i: block(f"transformer.{name}.{i}.") for i in range(n)}

  out = {
    "embed": get("transformer.wte.weight", (vocab_size, D)),
    "norm": {"scale": get("transformer.ln_f.weight", (D,))},
    "core": group("core_block", cfg.num_layers),
    "adapter": get("transformer.adapter.weight", (D, 2 * D)).T,
    "adapter_b": hf_dir.zeros(D),
  }
  return out | {
    g: group(g, n)
    for g, n in (("prelude", cfg.num_prelude), ("coda", cfg.num_coda))
    if n
  }
