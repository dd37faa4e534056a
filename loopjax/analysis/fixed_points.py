"""Fixed points of the recurrence, layer by layer.

For each layer l of the core, the relative change of its output between
successive iterations, ||h_l(r+1) - h_l(r)|| / ||h_l(r)|| (Frobenius norm over
the example's real tokens and the model dimension), and how far apart the
different layers' outputs are after the last iteration (relative distance
||h_l - h_m|| / ||h_l||, and cosine, which a residual stream keeps near 1).
Every layer's change going to 0 while the layers' limit states stay apart (by
more than the tolerance) is a cyclic fixed point: the block cycles through L
states, one per layer. One shared limit state is a plain fixed point. A state
repeating every p > 1 iterations (a limit cycle of the whole block) shows in
`period`; `kind` names which of these the mean curves show.
"""

import jax.numpy as jnp
import numpy as np

MAX_PERIOD = 4


def _norm(x_BTD, mask_BT):
  """Frobenius norm over real tokens x dimensions, (..., B)."""
  mask = mask_BT.reshape((1,) * (x_BTD.ndim - 3) + (*mask_BT.shape, 1))
  return jnp.sqrt(((x_BTD * mask) ** 2).sum((-2, -1)))


def per_example(trace: dict, batch, pad_id: int) -> dict:
  """change (B, R-1, L); cosine and distance (B, L, L) between the last
  iteration's layer outputs; lag (B, P, L): distance of the last state to the
  one p = 1..P iterations before, relative to the earlier one (as `change`:
  lag p = 1 is the last change)."""
  h_RLBTD = trace["core"]["hidden"].astype(jnp.float32)
  mask_BT = (batch["inputs"] != pad_id).astype(jnp.float32)
  size_RLB = _norm(h_RLBTD, mask_BT)
  change_RLB = _norm(h_RLBTD[1:] - h_RLBTD[:-1], mask_BT) / size_RLB[:-1]
  last_LBTD = h_RLBTD[-1] * mask_BT[None, :, :, None]
  flat_LBF = last_LBTD.reshape(*last_LBTD.shape[:2], -1)
  unit_LBF = flat_LBF / jnp.linalg.norm(flat_LBF, axis=-1, keepdims=True)
  cosine_BLL = jnp.einsum("lbf,mbf->blm", unit_LBF, unit_LBF)
  gap_LLB = _norm(h_RLBTD[-1][:, None] - h_RLBTD[-1][None], mask_BT)
  distance_BLL = jnp.moveaxis(gap_LLB / size_RLB[-1][:, None, :], -1, 0)
  R = h_RLBTD.shape[0]
  lag_PLB = jnp.stack(
    [
      _norm(h_RLBTD[-1] - h_RLBTD[-1 - p], mask_BT) / size_RLB[-1 - p]
      for p in range(1, min(MAX_PERIOD, R - 1) + 1)
    ]
  )
  return {
    "change": jnp.moveaxis(change_RLB, -1, 0),
    "cosine": cosine_BLL,
    "distance": distance_BLL,
    "lag": jnp.moveaxis(lag_PLB, -1, 0),
  }


def converged_at(change_R: np.ndarray, tol: float) -> int | None:
  """The first iteration r from which every later change is below `tol`
  (entry r-1 of `change` compares iterations r and r+1), or None."""
  above = np.flatnonzero(np.asarray(change_R) >= tol)
  if not above.size:
    return 1
  r = int(above[-1]) + 2
  return r if r <= len(change_R) else None


def summarize(examples: dict, tol: float) -> dict:
  """Per layer: the mean change curve, the iteration it converges at (mean
  curve below `tol` from then on), the share of examples whose last change is
  below `tol`, the period (smallest p whose mean lag is below `tol`, else
  None); the mean cosine and distance matrices between layers' limit states;
  and the `kind` of limit: "fixed point", "cyclic fixed point", "cycle of
  period p" or "not converged"."""
  change_RL = examples["change"].mean(0)
  lag_PL = examples["lag"].mean(0)
  layers = []
  for l in range(change_RL.shape[1]):
    periods = np.flatnonzero(lag_PL[:, l] < tol)
    layers.append(
      {
        "change": change_RL[:, l].tolist(),
        "converged_at": converged_at(change_RL[:, l], tol),
        "converged_share": float((examples["change"][:, -1, l] < tol).mean()),
        "period": int(periods[0]) + 1 if periods.size else None,
      }
    )
  distance_LL = examples["distance"].mean(0)
  return {
    "tol": tol,
    "kind": _kind(layers, distance_LL, tol),
    "layers": layers,
    "cosine": examples["cosine"].mean(0).tolist(),
    "distance": distance_LL.tolist(),
  }


def _kind(layers: list[dict], distance_LL: np.ndarray, tol: float) -> str:
  if all(x["converged_at"] is not None for x in layers):
    apart = distance_LL[~np.eye(len(layers), dtype=bool)]
    return "cyclic fixed point" if apart.size and apart.min() > tol else "fixed point"
  periods = {x["period"] for x in layers}
  if len(periods) == 1 and None not in periods:
    return f"cycle of period {periods.pop()}"
  return "not converged"
