"""Ouro (ByteDance, 2025; `OuroForCausalLM`, model_type ouro) as a
LoopedTransformer.

The whole stack is the core, looped `total_ut_steps` times (4) with no
prelude, coda or input injection; its layers are Llama's with "sandwich"
norms (each sublayer pre-normed and its output normed before the add:
input_layernorm, input_layernorm_2, post_attention_layernorm,
post_attention_layernorm_2 -> norm1, norm1_out, norm2, norm2_out). The final
norm is applied to the stream after every loop step and the next step starts
from the normed state (`state_norm`); the head reads it as is. A linear exit
gate on each step's state (early_exit_gate, `exit_gate`) gives the
probability of exiting there given not earlier; `loopjax.halting`'s "gate"
criterion exits where the cumulative probability reaches a threshold.
"""

from loopjax.errors import ConfigError
from loopjax.pretrained import llama

MODEL_TYPE = "ouro"
ARCHITECTURE = "OuroForCausalLM"
FIXED = llama.FIXED | {"use_sliding_window": False}
# What Ouro's configuration class (its Hugging Face repositories') takes for
# fields config.json leaves out.
DEFAULTS = dict(rms_norm_eps=1e-6, rope_theta=10_000.0, max_position_embeddings=32768)
NORMS = {
  "norm1": "input_layernorm",
  "norm1_out": "input_layernorm_2",
  "norm2": "post_attention_layernorm",
  "norm2_out": "post_attention_layernorm_2",
}


def model_config(hf: dict, base, split=None, num_loops: int | None = None):
  """(loopjax `model` config, vocab size, max length); `num_loops` defaults
  to the trained `total_ut_steps`. Ouro loops its whole stack: no split."""
  if split is not None:
    raise ConfigError("model.hf_split: Ouro loops its whole stack (no split)")
  kinds = set(hf.get("layer_types") or ["full_attention"])
  if kinds != {"full_attention"}:
    raise ConfigError(
      f"config.json: layer_types must all be 'full_attention' (sliding-window "
      f"layers are not supported); got {sorted(kinds)}"
    )
  cfg, vocab_size, max_len = llama.decoder_config(
    hf, base, ARCHITECTURE, FIXED, DEFAULTS
  )
  cfg.update(
    norm_position="sandwich",
    num_loops=num_loops or hf.get("total_ut_steps", 4),
    state_norm=True,
    exit_gate=True,
  )
  return cfg, vocab_size, max_len


def params(hf_dir, cfg, vocab_size: int) -> dict:
  """The LoopedTransformer's params (a pure dict, in `hf_dir.dtype`) from
  `hf_dir`'s tensors."""
  D = cfg.d_model

  def layer(i):
    at = f"model.layers.{i}."
    norms = {
      ours: {"scale": hf_dir.take(at + f"{theirs}.weight", (D,))}
      for ours, theirs in NORMS.items()
    }
    return llama.attention_mlp(hf_dir, cfg, at) | norms

  return llama.embed_and_head(hf_dir, cfg, vocab_size) | {
    "core": {i: layer(i) for i in range(cfg.num_layers)},
    "gate_w": hf_dir.take("model.early_exit_gate.weight", (1, D))[0],
    "gate_b": hf_dir.take("model.early_exit_gate.bias", (1,))[0],
  }
