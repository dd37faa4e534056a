"""Fixed points of the recurrence, layer by layer, decided per token.

The raw relative change ||h_l(r+1) - h_l(r)|| / ||h_l(r)|| of a pre-norm
residual stream cannot show a fixed point: once the state's direction settles,
each iteration adds a near-constant update, the norm grows linearly and that
ratio falls like 1/r whatever the dynamics. So for each token and layer l the
analysis measures what the next layer reads, `read_l(h)` (its input norm, with
the input injected first for the block's last layer):

- `change`: ||read(h(r+1)) - read(h(r))|| / ||read(h(r))||, the verdict's metric;
- `cosine`: cos(h(r), h(r+1)) (MECH's and Huginn's measure);
- `update`: ||delta(r) - delta(r-1)|| / ||delta(r-1)|| with delta(r) =
  h(r+1) - h(r): how constant the update is (0: the same update every
  iteration, a stream growing linearly). Not a convergence test: a state
  approaching its limit geometrically keeps it at |1 - rho|;
- `raw`: the raw relative change above, for comparison;
- `to_last`: ||read(h(r)) - read(h(R))|| / ||read(h(R))||, the distance to the
  last iterate analyzed, and `cosine_last`: cos(h(r), h(R)) (MECH's measures,
  over its horizon of R = 128 iterations).

A token has converged from the first iteration after which its `change` stays
below `tol`; a layer converges at the iteration by which a share `share` of the
real tokens have (`converged_at_tol`: the same at each tolerance of LADDER).
MECH's verdict, `settled_at` (and `settled_at_tol`), is the same with
`to_last` in place of `change`: from when the state stays within `tol` of the
last one. A drift slower than `tol` per iteration settles by this measure
near the horizon, never by `change`, so the kind of limit is decided on
`change`. Its period is the smallest p at which that share of tokens'
read states equal (within `tol`) their own p iterations back. The limits of
different layers are compared by what the next layer reads: the distance
||read_l(h_m) - read_l(h_l)|| / ||read_l(h_l)|| (per token, median over
tokens), how different layer m's limit looks to the layer that reads layer l's
(in a growing pre-norm stream raw directions draw together like 1/r; reads
do not unless the block stops mattering). Every layer converged with every
pair of limits further apart than `margin` is a cyclic fixed point (the block
cycles through L states, one per layer); a block of one layer, or limits
closer than `margin`, is a plain fixed point.
"""

import jax.numpy as jnp
import numpy as np

MAX_PERIOD = 4
# Besides `tol`, where each layer reaches these (the tables' coarser view).
LADDER = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3)
CURVES = ("change", "cosine", "update", "raw", "to_last", "cosine_last")


def next_layer_reads(model, x_BTD):
  """read(h_LBTD) -> (..., L, B, T, D): each core layer's output as the layer
  after it reads it (its input norm; none for post-norm and res_post blocks,
  which read the stream as it is); the last layer's is read by the first
  after injection."""
  core = list(model.core)

  def norm1(block, h):
    return h if block.position in ("post", "res_post") else block.norm1(h)

  def last(h):  # any leading axes: the input broadcast to them
    x = jnp.broadcast_to(x_BTD, h.shape)
    return norm1(core[0], model.inject(model.end_iteration(h), x))

  def read(h_LBTD):
    outs = [norm1(core[l + 1], h_LBTD[..., l, :, :, :]) for l in range(len(core) - 1)]
    outs.append(last(h_LBTD[..., -1, :, :, :]))
    return jnp.stack(outs, -4).astype(jnp.float32)

  return read


def _rel(a, b):
  """||a - b|| / ||b|| over the last axis."""
  return jnp.linalg.norm(a - b, axis=-1) / (jnp.linalg.norm(b, axis=-1) + 1e-30)


def _unit(h):
  return h / (jnp.linalg.norm(h, axis=-1, keepdims=True) + 1e-30)


def step_metrics(h_prev, h_cur, read_prev, read_cur, delta_prev):
  """Per token (..., L, B, T): change, cosine, raw between two successive
  iterations' layer outputs, and update against `delta_prev`, the previous
  pair's update (the callers drop the entries without one); also this
  update, (..., L, B, T, D)."""
  h_prev, h_cur = h_prev.astype(jnp.float32), h_cur.astype(jnp.float32)
  delta = h_cur - h_prev
  cos = (_unit(h_prev) * _unit(h_cur)).sum(-1)
  out = {
    "change": _rel(read_cur, read_prev),
    "cosine": cos,
    "update": _rel(delta, delta_prev),
    "raw": _rel(h_cur, h_prev),
  }
  return out, delta


def to_last(h_LBTD, read_LBTD, last_h_LBTD, last_read_LBTD):
  """Per token (L, B, T): `to_last` and `cosine_last` of one iteration."""
  cos = (_unit(h_LBTD.astype(jnp.float32)) * _unit(last_h_LBTD)).sum(-1)
  return {"to_last": _rel(read_LBTD, last_read_LBTD), "cosine_last": cos}


def limit_metrics(read, h_LBTD, read_PLBTD, read_LBTD):
  """At the last iteration, per token: lag (P, L, B, T), the relative distance
  of each layer's read state to its own p = 1..P iterations back
  (`read_PLBTD`, most recent first), and distance (L, L, B, T), entry [l, m]
  how far layer m's state is from layer l's as the reader of l sees them."""
  lag = _rel(read_LBTD[None], read_PLBTD)
  L = h_LBTD.shape[0]
  cross_MLBTD = read(jnp.broadcast_to(h_LBTD[:, None], (L, *h_LBTD.shape)))
  distance = _rel(cross_MLBTD, read_LBTD[None]).swapaxes(0, 1)
  return {"lag": lag, "distance": distance}


def per_example(model, trace: dict, batch, pad_id: int) -> dict:
  """`from_stream` on a full trace (the knowledge-graph probes)."""
  x_BTD = (trace["prelude"] or {"hidden": trace["embed"][None]})["hidden"][-1]
  read = next_layer_reads(model, x_BTD)
  return from_stream(trace["core"]["hidden"], read, batch["inputs"] != pad_id)


def from_stream(h_RLBTD, read, real_BT) -> dict:
  """Per token, from every layer's output at every iteration: the curves (B, T,
  R-1, L), entry i at iteration i + 2 (`update`: (B, T, R-2, L)), lag (B, T,
  P, L), distance (B, T, L, L), and the real-token mask `real` (B, T).
  `read`: `next_layer_reads` (or any map of (..., L, B, T, D) states, for a
  stream without a model). Computed in float32, as the streamed pass
  computes it."""
  h_RLBTD = h_RLBTD.astype(jnp.float32)
  r_RLBTD = read(h_RLBTD)
  R = h_RLBTD.shape[0]
  delta_RLBTD = h_RLBTD[1:] - h_RLBTD[:-1]
  curves, _ = step_metrics(
    h_RLBTD[:-1],
    h_RLBTD[1:],
    r_RLBTD[:-1],
    r_RLBTD[1:],
    jnp.concatenate([delta_RLBTD[:1], delta_RLBTD[:-1]]),
  )
  curves["update"] = curves["update"][1:]
  curves |= to_last(h_RLBTD[1:], r_RLBTD[1:], h_RLBTD[-1:], r_RLBTD[-1:])
  P = min(MAX_PERIOD, R - 1)
  limits = limit_metrics(read, h_RLBTD[-1], r_RLBTD[-1 - P : -1][::-1], r_RLBTD[-1])
  return tokens_first(curves | limits) | {"real": real_BT}


def tokens_first(out: dict) -> dict:
  """(X, Y, B, T) arrays as (B, T, X, Y): examples first, for batching."""
  return {k: jnp.moveaxis(v, (-2, -1), (0, 1)) for k, v in out.items()}


def _after_last_above(x_NR: np.ndarray, tol: float) -> np.ndarray:
  """Per token, the index after the last entry at or above `tol` (0: none)."""
  above_NR = np.asarray(x_NR) >= tol
  n = above_NR.shape[1]
  return np.where(above_NR.any(1), n - np.argmax(above_NR[:, ::-1], 1), 0)


def converged_from(change_NR: np.ndarray, tol: float) -> np.ndarray:
  """Per token, the first iteration r from which every later change is below
  `tol` (entry r-1 compares iterations r and r+1); inf where the last is not."""
  k_N, n = _after_last_above(change_NR, tol), np.shape(change_NR)[1]
  return np.where(k_N < n, k_N + 1, np.inf).astype(float)


def settled_from(to_last_NR: np.ndarray, tol: float) -> np.ndarray:
  """Per token, the first iteration from which `to_last` stays below `tol`
  (entry i is iteration i + 2; iteration 1 is not compared); inf where only
  the last iterate is (itself: distance 0)."""
  k_N, n = _after_last_above(to_last_NR, tol), np.shape(to_last_NR)[1]
  return np.where(k_N < n - 1, k_N + 2, np.inf).astype(float)


def summarize(examples: dict, tol: float, share: float, margin: float) -> dict:
  """Per layer: median curves over real tokens, `converged_at` (the iteration
  by which `share` of the tokens have converged, or None), `converged_share`
  (tokens converged by the last iteration), `settled_at` (MECH's, by the
  distance to the last iterate), both on the tolerance ladder, and `period`;
  the median distance between the layers' limits; and the `kind` of limit:
  "fixed point", "cyclic fixed point", "cycle of period p" or "not
  converged"."""
  real = np.asarray(examples["real"], bool)
  tok = {k: np.asarray(v)[real] for k, v in examples.items() if k != "real"}
  L = tok["change"].shape[-1]
  layers = []
  for l in range(L):
    at_N = converged_from(tok["change"][:, :, l], tol)
    reached = _reached(at_N, share)
    periods = [
      p + 1
      for p in range(tok["lag"].shape[1])
      if (tok["lag"][:, p, l] < tol).mean() >= share
    ]
    layers.append(
      {k: np.median(tok[k][:, :, l], 0).tolist() for k in CURVES}
      | {
        "change_p90": np.quantile(tok["change"][:, :, l], 0.9, 0).tolist(),
        "converged_at": reached,
        "converged_at_tol": {
          str(t): _reached(converged_from(tok["change"][:, :, l], t), share)
          for t in LADDER
        },
        "converged_share": float(np.isfinite(at_N).mean()),
        "settled_at": _reached(settled_from(tok["to_last"][:, :, l], tol), share),
        "settled_at_tol": {
          str(t): _reached(settled_from(tok["to_last"][:, :, l], t), share)
          for t in LADDER
        },
        "period": periods[0] if periods else None,
      }
    )
  distance_LL = np.median(tok["distance"], 0)
  return {
    "tol": tol,
    "share": share,
    "margin": margin,
    "tokens": int(real.sum()),
    "kind": kind(layers, distance_LL, margin),
    "layers": layers,
    "distance": distance_LL.tolist(),
  }


def from_pass(examples: dict, inputs) -> dict:
  """`summarize` of the shared pass's outputs (by analysis name) at the run's
  `analyze` settings (`inputs`: a record.Inputs): the record's, a knowledge
  graph's and a language model's alike."""
  a = inputs.config.analyze
  return summarize(examples["fixed_points"], a.tol, a.fp_share, a.cycle_margin)


def _reached(at_N: np.ndarray, share: float) -> int | None:
  """The iteration by which `share` of the tokens have converged, or None."""
  r = np.sort(at_N)[int(np.ceil(share * len(at_N))) - 1]
  return None if np.isinf(r) else int(r)


def kind(layers: list[dict], distance_LL: np.ndarray, margin: float) -> str:
  periods = {x["period"] for x in layers}
  if all(x["converged_at"] is not None for x in layers):
    apart = distance_LL[~np.eye(len(layers), dtype=bool)]
    return (
      "cyclic fixed point" if apart.size and apart.min() > margin else "fixed point"
    )
  if len(periods) == 1 and None not in periods and periods != {1}:
    return f"cycle of period {periods.pop()}"
  return "not converged"
