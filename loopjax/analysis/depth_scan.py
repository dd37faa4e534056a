"""A language model's recurrence run once, every layer's statistics reduced as
it goes, so memory does not grow with the number of iterations.

`LoopedTransformer.trace` stacks every layer's output and attention weights,
(R, L, B, N, T, T) of them: at 512 tokens and R = 32 that is gigabytes. Here
`recurrence.unroll` (the scan training runs, one iteration per step) iterates
the model's own pieces (`inject`, the core blocks with their weights,
`end_iteration`, `logits`) and keeps, besides the state, what the next
iteration's statistics compare against: the previous iteration's layer
outputs, their reads and updates, the reads P iterations back and the previous
iteration's attention weights. Each iteration emits only per-sequence and
per-token scalars (`stages.layer_stats`, `stages.head_stats`,
`fixed_points.step_metrics`), so the peak holds a few iterations' attention
weights, whatever R is (`lm.analyze.memory` measures it). The distance to the
last iterate needs that iterate first: a plain pass of the recurrence finds
it, then the measured pass compares every iteration with it.
"""

import jax
import jax.numpy as jnp

from loopjax import recurrence
from loopjax.analysis import attention, fixed_points, stages


def _stack(xs):
  """A list of equal pytrees as one, stacked on a new leading axis (None: empty)."""
  return jax.tree.map(lambda *a: jnp.stack(a), *xs) if xs else None


def _batch_first(tree, axis: int):
  return jax.tree.map(lambda a: jnp.moveaxis(a, axis, 0), tree)


def _group(blocks, h_BTD, batch, first_BT, logits_fn):
  """h through `blocks`, and stacked per block: layer statistics, head
  statistics, outputs (float32), attention weights and column sums."""
  out = {k: [] for k in ("layer", "heads", "hidden", "probs", "colsum")}
  for block in blocks:
    h_BTD, probs_BNTS = block(h_BTD, with_probs=True, segments_BT=batch["segments"])
    heads, p_BNS = stages.head_stats(probs_BNTS, batch["real"], first_BT)
    out["layer"].append(stages.layer_stats(h_BTD, batch, first_BT, logits_fn))
    out["heads"].append(heads)
    out["hidden"].append(h_BTD.astype(jnp.float32))
    out["probs"].append(probs_BNTS.astype(jnp.float32))
    out["colsum"].append(p_BNS)
  return h_BTD, {k: _stack(v) for k, v in out.items()}


def last_iterate(m, h_BTD, x_BTD, segments_BT, num_loops: int):
  """The core's layer outputs (L, B, T, D), float32, at iteration
  `num_loops`, computed as the measured pass computes them (with_probs)."""

  def iteration(carry):
    h_BTD, layers = m.core_step(carry[0], x_BTD, True, segments_BT)
    return h_BTD, layers["hidden"].astype(jnp.float32)

  L, shape = len(m.core), h_BTD.shape
  carry = (h_BTD, jnp.zeros((L, *shape), jnp.float32))
  return recurrence.unroll(iteration, carry, num_loops)[0][1]


def run(model, batch, num_loops: int, key=None) -> dict:
  """Per sequence, batch axis first: "embed", "prelude"/"coda" (B, P, ...),
  "core" (B, R, L, ...) layer statistics with their heads' ("*_heads"),
  "fixed_points" (`fixed_points.from_stream`'s layout) and "attention":
  sink, top_share, entropy, concentration (B, R, L, N), stability (B, R-1, L,
  N), the last iteration's column sums, profile (B, 1, L, N, S) (the full
  trace's layout with one iteration), and the uniform baselines (B,)."""
  m, real_BT = model, batch["real"]
  first_BT = stages.first_tokens(batch["segments"])
  x_BTD = m.embed_tokens(batch["inputs"])
  out = {
    "embed": stages.layer_stats(x_BTD, batch, first_BT, m.logits),
  }
  # what uniform causal attention would give: depends on the windows only
  baselines = attention.uniform(real_BT, first_BT)
  out["uniform_concentration"] = baselines["uniform_concentration"]
  x_BTD, prelude = _group(m.prelude, x_BTD, batch, first_BT, m.logits)
  h_BTD = m.initial_state(x_BTD, key)
  read = fixed_points.next_layer_reads(m, x_BTD)
  (B, T, D), L, N = h_BTD.shape, len(m.core), m.cfg.num_heads
  P = min(fixed_points.MAX_PERIOD, num_loops - 1)
  last_h = last_iterate(m, h_BTD, x_BTD, batch["segments"], num_loops)
  last_read = read(last_h)
  zeros = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
  prev0 = {
    "h": zeros(L, B, T, D),
    "read": zeros(L, B, T, D),
    "delta": zeros(L, B, T, D),
    "ring": zeros(max(P, 1), L, B, T, D),  # the reads 1..P iterations back
    "probs": zeros(L, B, N, T, T),
    "colsum": zeros(L, B, N, T),
  }

  def iteration(carry):
    h_BTD, prev, _ = carry
    h_BTD, core = _group(m.core, m.inject(h_BTD, x_BTD), batch, first_BT, m.logits)
    read_L = read(core["hidden"])
    curves, delta = fixed_points.step_metrics(
      prev["h"], core["hidden"], prev["read"], read_L, prev["delta"]
    )
    curves |= fixed_points.to_last(core["hidden"], read_L, last_h, last_read)
    tv_LBNT = 0.5 * jnp.abs(core["probs"] - prev["probs"]).sum(-1)
    queries = real_BT.astype(jnp.float32)[None, :, None]
    ys = {
      "layer": core["layer"],
      "heads": core["heads"],
      "curves": curves,
      "stability": (tv_LBNT * queries).sum(-1) / queries.sum(-1),
    }
    new = {
      "h": core["hidden"],
      "read": read_L,
      "delta": delta,
      "ring": jnp.concatenate([prev["read"][None], prev["ring"][:-1]]),
      "probs": core["probs"],
      "colsum": core["colsum"],
    }
    return m.end_iteration(h_BTD), new, ys

  # The iteration's statistics ride in the carry (zeros before the first), read
  # out after every iteration by the same `recurrence.unroll` as training.
  ys0 = jax.eval_shape(iteration, (h_BTD, prev0, None))[2]
  ys0 = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), ys0)
  (h_BTD, last, _), ys = recurrence.unroll(
    iteration,
    (h_BTD, prev0, ys0),
    num_loops,
    scan_unroll=1,  # unrolled groups would hold several iterations' weights
    readout=lambda carry: carry[2],
  )
  _, coda = _group(m.coda, m.coda_in(h_BTD), batch, first_BT, m.logits)
  groups = {"prelude": prelude, "coda": coda}
  return _outputs(out, groups, ys, last, read, P, real_BT) | {
    "attention": _attention(ys, last) | baselines
  }


def _outputs(out, groups, ys, last, read, P, real_BT) -> dict:
  """`run`'s layer statistics, batch axis first, and its fixed points."""
  for name, group in groups.items():  # (P, B, ...)
    out[name] = _batch_first(group["layer"], 1)
    out[f"{name}_heads"] = _batch_first(group["heads"], 1)
  out["core"], out["core_heads"] = (
    _batch_first(ys["layer"], 2),
    _batch_first(ys["heads"], 2),
  )
  # (R, L, B, T), entry i comparing iterations i + 1 and i + 2 (1-based); the
  # first has no previous state to compare, the update's first two none.
  curves = {k: v[1:] for k, v in ys["curves"].items()}
  curves["update"] = ys["curves"]["update"][2:]
  limits = fixed_points.limit_metrics(read, last["h"], last["ring"][:P], last["read"])
  out["fixed_points"] = fixed_points.tokens_first(curves | limits) | {"real": real_BT}
  return out


def _attention(ys, last) -> dict:
  """`run`'s attention statistics, batch axis first (without the baselines)."""
  heads = {k: ys["heads"][k] for k in ("sink", "top_share", "entropy", "concentration")}
  out = _batch_first(heads | {"stability": ys["stability"][1:]}, 2)
  out["profile"] = _batch_first(last["colsum"], 1)[:, None]
  return out
