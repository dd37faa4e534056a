"""Retrofitted recurrence (McLeish et al. 2025, "Teaching Pretrained Language
Models to Think Deeper with Retrofitted Recurrence") as a LoopedTransformer.

A pretrained Llama (TinyLlama, Llama 3.2) or OLMo 2 with its layers laid out
as Huginn's prelude, recurrent core and coda: each iteration starts from a
linear adapter of concat(state, prelude output) (`injection` concat, no bias),
and the final norm follows the coda only (`coda_norm` off). The checkpoints
keep Huginn-0125's model_type, architecture and tensor names, so `family`
tells the three apart by their blocks' tensors (Huginn's four norms; OLMo's
q / k norms), or, from config.json alone, by Huginn's q / k bias and the
modeling module its auto_map names.

The blocks are the source model's own: Llama's pre-norm (norm_1 / norm_2 ->
norm1 / norm2, `norm_position` "pre"), OLMo 2's norms on the sublayer outputs
("res_post", the same names) with queries and keys normalized across heads
before RoPE (`qk_norm`). The fused Wqkv stacks q (N heads), then k and v (K
each) on its output axis; fc, the gate and up halves. RoPE is transformers'
Llama rotary embedding: rotate-half pairing, base rope_theta (the rope_base
the converters also write is not read), Llama 3's rescaling where rope_scaling
(5.x: rope_parameters) is llama3 (`rope_llama3`). The embedding scale, and
with it the first state's std (a truncated normal), are config.json's
init_values as stored: the converters keep Huginn's std for its 5280 wide
model and set the scale to 1. The head is untied unless tie_embeddings says
otherwise.
"""

from functools import partial
from types import SimpleNamespace

import ml_collections
import numpy as np

from loopjax.errors import ConfigError
from loopjax.pretrained import huginn, llama
from loopjax.pretrained.hf_dir import check_config

ARCHITECTURE = huginn.ARCHITECTURE
FIXED = {"bias": False, "injection_type": "linear", "qk_bias": False,
         "test_time_noise": 0, "partial_rotary_factor": 1.0}  # fmt: skip
# OLMo's initial_state_mode -> init_state ("skip-adapter", whose first
# iteration bypasses the adapter, has no loopjax equivalent). The Llama code
# draws the random state whatever the field says.
INIT_MODES = {"random": "trunc_normal", "embed-init": "embedding"}


def model_config(hf: dict, base, split=None, num_loops=None, source="llama"):
  """(loopjax `model` config, vocab size, max length) of a model retrofitted
  from `source` ("llama" or "olmo2"); `num_loops` defaults to the trained
  mean recurrence."""
  check_config(hf, ARCHITECTURE, FIXED)
  if split is not None:
    raise ConfigError(
      "model.hf_split: a retrofitted model's prelude, core and coda are its own"
    )
  D, N = hf["n_embd"], hf["n_heads"]
  max_len = hf.get("max_position_embeddings", hf.get("block_size", 4096))
  # checks head_dim; the base is required (the converters always write it)
  shape = llama.swiglu_rope(hf, D, N, ("n_embd", "n_heads"), max_len, None)
  init = hf.get("init_values") or {}
  embed_scale = float(init.get("embed_scale", 1.0))
  std = float(init.get("std", (2 / (5 * D)) ** 0.5)) * embed_scale
  mode = hf.get("initial_state_mode", "random") if source == "olmo2" else "random"
  if mode not in INIT_MODES:
    raise ConfigError(
      f"config.json: initial_state_mode must be one of {', '.join(INIT_MODES)} "
      f"(not supported otherwise); got {mode!r}"
    )
  cfg = ml_collections.ConfigDict(base.to_dict())
  cfg.update(
    shape,
    norm_position="res_post" if source == "olmo2" else "pre",
    norm_eps=float(hf.get("norm_eps", 1e-6)),
    qk_norm=source == "olmo2",
    embed_scale=embed_scale,
    num_prelude=hf["n_layers_in_prelude"],
    num_layers=hf["n_layers_in_recurrent_block"],
    num_coda=hf["n_layers_in_coda"],
    num_loops=num_loops or hf["mean_recurrence"],
    injection="concat",
    # std 0: the reference's state is zeros
    init_state=INIT_MODES[mode] if std > 0 or mode != "random" else "zeros",
    init_state_std=std if std > 0 else 1.0,
    coda_norm=False,
    state_norm=False,
    exit_gate=False,
    tie_embeddings=bool(hf.get("tie_embeddings", True)),
  )
  vocab = hf.get("padded_vocab_size", hf["vocab_size"])
  return cfg, vocab, max_len


def params(hf_dir, cfg, vocab_size: int) -> dict:
  """The LoopedTransformer's params (a pure dict, in `hf_dir.dtype`) from
  `hf_dir`'s tensors."""
  D, N, F = cfg.d_model, cfg.num_heads, cfg.mlp_hidden
  K, H, get = cfg.num_kv_heads or N, D // N, hf_dir.take

  def block(at):
    w_DQ = get(at + "attn.Wqkv.weight", ((N + 2 * K) * H, D)).T
    q_DQ, k_DQ, v_DQ = np.split(w_DQ, [N * H, (N + K) * H], axis=1)
    o_QD = get(at + "attn.proj.weight", (D, N * H)).T
    return {
      "attn": llama.attention(hf_dir, cfg, q_DQ, k_DQ, v_DQ, o_QD, at + "attn."),
      "mlp": {
        "w_in": get(at + "mlp.fc.weight", (2 * F, D)).T.reshape(D, 2, F),
        "w_out": get(at + "mlp.proj.weight", (D, F)).T,
      },
      "norm1": {"scale": get(at + "norm_1.weight", (D,))},
      "norm2": {"scale": get(at + "norm_2.weight", (D,))},
    }

  out = huginn.raven_params(hf_dir, cfg, vocab_size, block)
  if not cfg.tie_embeddings:
    out["unembed"] = get("lm_head.weight", (vocab_size, D)).T
  elif "lm_head.weight" in hf_dir.files:  # tied: some exports store it anyway
    hf_dir.skip("lm_head.weight")
  return out


LLAMA = SimpleNamespace(model_config=model_config, params=params)
OLMO2 = SimpleNamespace(
  model_config=partial(model_config, source="olmo2"), params=params
)
# The modeling module each converter saves, as config.json's auto_map names
# it: what tells the two apart without their tensors.
CODES = {"raven_modeling_minimal_llama": LLAMA, "raven_modeling_minimal_olmo": OLMO2}


def family(hf_dir):
  """The family of a huginn_raven directory: `huginn` where `huginn.owns` it,
  else the retrofitted OLMo 2 or Llama, by their tensors (OLMo's q / k norms)
  or, where there are none (a shape for `aot`), by the modeling module
  config.json's auto_map names."""
  names, hf = hf_dir.stored(), hf_dir.config
  if huginn.owns(hf, names):
    return huginn
  if names:
    return OLMO2 if any(n.endswith(".attn.q_norm.weight") for n in names) else LLAMA
  auto = hf.get("auto_map")
  code = str(auto.get("AutoModelForCausalLM", "")) if isinstance(auto, dict) else ""
  # "module.Class", or "repo--module.Class" as a copy from the hub saves it
  if (module := code.rpartition(".")[0].rpartition("--")[2]) in CODES:
    return CODES[module]
  raise ConfigError(
    f"{hf_dir.path / 'config.json'}: a retrofitted model's config alone does "
    f"not say whether its blocks are Llama's or OLMo 2's (auto_map's "
    f"AutoModelForCausalLM names neither {' nor '.join(CODES)}: {code!r}); "
    "add its weights"
  )
