"""Each config field's own rule, as tables: the names an enum field allows and
the bounds of a number (`config.validate` applies them first, then the rules
that relate fields). JAX-free."""

import math

from loopjax import task
from loopjax.errors import ConfigError
from loopjax.names import ATTENTION_KERNELS, HALTING_CRITERIA, HALTING_START

ENUMS = {
  "data.task": task.FAMILIES.keys(),  # a view: a family registered later is in it
  "model.pos_encoding": ("learned", "sinusoidal", "rope", "none"),
  "model.injection": ("none", "add", "concat"),
  "model.norm_position": ("pre", "sandwich", "residual", "post", "res_post"),
  "model.mlp_type": ("gelu", "swiglu"),
  "model.rope_pairing": ("half", "interleaved"),
  "model.norm_type": ("layernorm", "rmsnorm"),
  "model.init_state": ("embedding", "zeros", "random", "trunc_normal"),
  "model.remat": ("none", "full", "dots"),
  "model.past_depth": ("auto", "skip", "mask"),
  "model.attention": ATTENTION_KERNELS,
  "model.dtype": ("float32", "bfloat16"),
  "train.schedule": ("constant", "cosine"),
  "train.supervise": ("last", "from_hops", "atomic_every"),
  "train.decay": ("matrices", "all"),
  "train.depth.dist": ("fixed", "poisson", "lognormal_poisson"),
  "train.grokfast.kind": ("none", "ema", "ma"),
  "train.grokfast.state_dtype": ("float32", "params"),
  "train.xent": ("softmax", "stablemax"),
  "analyze.halting.start": HALTING_START,
}
# Tuple fields whose every name must be one the owning module knows.
NAME_LISTS = {"analyze.halting.criteria": HALTING_CRITERIA}


def llama3_ok(v) -> bool:
  """`model.rope_llama3` is off, or four finite numbers its blend can use."""
  if len(v) == 0:
    return True
  numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)
  if len(v) != 4 or not numbers or not all(math.isfinite(x) for x in v):
    return False
  factor, low, high, context = v
  return factor >= 1 and 0 < low < high and context >= 1


# An iteration count (R, an evaluation or analysis depth, a halting rule's
# ceiling): 32x MECH's 128-iteration horizon. Each iteration runs the core once
# more, so a count in the billions runs until killed instead of failing.
MAX_ITERATIONS = 4096

# Simple bounds, one table: field -> (holds for a good value, what is allowed).
_AT_LEAST_1 = (lambda v: v >= 1, "must be >= 1")
_ITERATIONS = (
  lambda v: 1 <= v <= MAX_ITERATIONS,
  f"must be in [1, {MAX_ITERATIONS}] (field_rules.MAX_ITERATIONS)",
)
_AT_LEAST_0 = (lambda v: v >= 0, "must be >= 0")
_UNIT = (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]")
_HALF_OPEN_UNIT = (lambda v: 0.0 <= v < 1.0, "must be in [0, 1)")
BOUNDS = {
  **dict.fromkeys(
    (
      "data.num_entities",
      "data.num_relations",
      "data.out_degree",
      "data.probe_size",
      "data.atomic_repeat",
      "model.d_model",
      "model.num_heads",
      "model.mlp_ratio",
      "model.scan_unroll",
      "model.num_layers",
      "train.batch_size",
      "train.num_steps",
      "train.grokfast.window",
      "eval.batch_size",
      "checkpoint.every",
      "checkpoint.keep",
      "log_every",
      "analyze.batch_size",
      "analyze.lm_windows",
      "analyze.answer_tokens",
      "analyze.halting.r_min",
    ),
    _AT_LEAST_1,
  ),
  **dict.fromkeys(
    (
      "model.num_loops",
      "train.depth.max",
      "analyze.max_depth",
      "analyze.halting.r_max",
    ),
    _ITERATIONS,
  ),
  **dict.fromkeys(
    (
      "seed",
      "data.seed",
      "model.num_prelude",
      "model.num_coda",
      "model.num_kv_heads",
      "model.mlp_hidden",
      "train.warmup_steps",
      "train.decay_steps",
      "train.curriculum.last_stage_steps",
      "checkpoint.keep_every",
      "analyze.halting.seq_len",
    ),
    _AT_LEAST_0,
  ),
  **dict.fromkeys(("data.ood_ratio", "data.p_test_id"), _UNIT),
  **dict.fromkeys(
    (
      "train.b1",
      "train.b2",
      "train.label_smoothing",
      "train.grokfast.alpha",
      "train.param_ema",
    ),
    _HALF_OPEN_UNIT,
  ),
  "train.grokfast.lamb": (lambda v: v >= 0 and math.isfinite(v), "must be >= 0"),
  "data.phi": (lambda v: math.isfinite(v) and v >= 0, "must be a finite number >= 0"),
  "train.lr": (lambda v: v > 0 and math.isfinite(v), "must be > 0"),
  "train.curriculum.last_stage_lr": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
  # renewed every lease_s / 4: GCS takes about one write a second per object
  "checkpoint.lease_s": (lambda v: 10 <= v < math.inf, "must be >= 10 (seconds)"),
  "train.weight_decay": (lambda v: v >= 0, "must be >= 0 (0 disables)"),
  "train.grad_clip": (lambda v: v >= 0, "must be >= 0 (0 disables)"),
  "train.backprop_depth": (lambda v: v >= 0, "must be >= 0 (0: all iterations)"),
  "analyze.tol": (lambda v: v > 0, "must be > 0"),
  "analyze.fp_share": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
  "analyze.cycle_margin": (lambda v: v >= 0, "must be >= 0"),
  "analyze.sink_threshold": (lambda v: 0 < v < 1, "must be in (0, 1)"),
  "model.init_std": (lambda v: v >= 0 and math.isfinite(v), "must be >= 0"),
  "model.embed_init_std": (lambda v: v >= 0 and math.isfinite(v), "must be >= 0"),
  "model.out_init_scale": (lambda v: v >= 0 and math.isfinite(v), "must be >= 0"),
  "model.norm_eps": (lambda v: 0 < v < 1, "must be in (0, 1)"),
  "model.rope_theta": (lambda v: v > 1 and math.isfinite(v), "must be > 1"),
  "model.embed_scale": (lambda v: v > 0 and math.isfinite(v), "must be > 0"),
  "model.init_state_std": (lambda v: v > 0 and math.isfinite(v), "must be > 0"),
  "model.random_positions": (lambda v: v >= 0, "must be >= 0 (0 disables)"),
  "model.rope_llama3": (
    llama3_ok,
    "must be () or (factor >= 1, low_freq_factor > 0, high_freq_factor > "
    "low_freq_factor, original context length >= 1)",
  ),
  "train.eps": (lambda v: v > 0 and math.isfinite(v), "must be > 0"),
  "mesh.devices": (lambda v: v >= 0, "must be >= 0 (0 = all)"),
  "eval_every": (lambda v: v >= 0, "must be >= 0 (0: no in-loop evaluation)"),
}
# Checked only where the field is used: sampled depth (and, in their modules,
# chains runs and language models).
DEPTH_BOUNDS = {
  "train.depth.mean": (lambda v: math.isfinite(v) and v > 0, "must be > 0"),
  "train.depth.sigma": (lambda v: math.isfinite(v) and v >= 0, "must be >= 0"),
}


def _get(c, path):
  for k in path.split("."):
    c = c[k]
  return c


def check(c, table: dict) -> None:
  """Raises ConfigError for the first field of `table` whose value fails."""
  for field, (ok, allowed) in table.items():
    if not ok(_get(c, field)):
      raise ConfigError(f"{field}: {allowed}; got {_get(c, field)!r}")


def check_fields(c) -> None:
  """Raises ConfigError for the first field whose value its table refuses."""
  for field, allowed in ENUMS.items():
    if _get(c, field) not in allowed:
      raise ConfigError(
        f"{field}: must be one of {', '.join(allowed)}; got {_get(c, field)!r}"
      )
  for field, allowed in NAME_LISTS.items():
    for name in _get(c, field):
      if name not in allowed:
        raise ConfigError(
          f"{field}: each must be one of {', '.join(allowed)}; got {name!r}"
        )
  check(c, BOUNDS)
