"""Gradient transformations that shorten grokking, as `optax` transformations
placed before the optimizer (`state.make_optimizer`, `train.grokfast`,
`train.perp_grad`).

Grokfast (Lee et al. 2024, arXiv 2405.20233) amplifies the slow component of
the gradient: g' = g + lamb * lowpass(g), the low-pass an exponential moving
average (mu_t = alpha mu_{t-1} + (1 - alpha) g_t, started at the first
gradient as the paper's code starts it) or the mean of the last `window`
gradients (applied once the window is full, its warm-up). perp-Grad (Prieto
et al. 2025, arXiv 2501.04697) removes from each weight's gradient its
component along the weight, which after memorization only scales the logits,
and restores the gradient's norm, as the paper's OrthoGrad does.

The filters' state is params-shaped (the MA window: each param's last
`window` gradients stacked on a leading axis, their sum, the next to leave),
so it is sharded like the params (`sharding.state_shardings`: the window's
axis whole), saved in the checkpoint, and reset with the optimizer (a
curriculum stage's fresh one). It is float32 whatever the params' dtype
unless `train.grokfast.state_dtype` is "params": bfloat16 resolves 1/256 of a
value, so an average's (1 - alpha) share of a new gradient (2% at alpha
0.98, 0.1% at 0.999) is rounded coarsely or lost, and a running sum of 100
gradients drifts.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax


class EmaState(NamedTuple):
  count: jax.Array  # gradients seen (int32)
  mu: optax.Updates


def _zeros(params, dtype, lead=()):
  """Zeros shaped like each param (with `lead` axes before its own), in
  `dtype` (None: the param's)."""
  return jax.tree.map(lambda p: jnp.zeros((*lead, *p.shape), dtype or p.dtype), params)


def grokfast_ema(alpha: float, lamb: float, dtype=None) -> optax.GradientTransformation:
  """g + lamb * mu, mu the EMA of the gradients with decay `alpha`, held in
  `dtype` (None: the params')."""

  def init(params):
    return EmaState(jnp.zeros((), jnp.int32), _zeros(params, dtype))

  def update(grads, state, params=None):
    del params
    first = state.count == 0

    def one(m, g):
      g = g.astype(m.dtype)
      return jnp.where(first, g, alpha * m + (1 - alpha) * g)

    mu = jax.tree.map(one, state.mu, grads)
    out = jax.tree.map(lambda g, m: (g + lamb * m).astype(g.dtype), grads, mu)
    return out, EmaState(optax.safe_increment(state.count), mu)

  return optax.GradientTransformation(init, update)


class MaState(NamedTuple):
  count: jax.Array  # gradients seen (int32)
  window: optax.Updates  # per param (window, *shape): gradient t at slot t % window
  total: optax.Updates  # the sum of the window's slots
  leaving: optax.Updates  # the slot the next gradient replaces


def grokfast_ma(window: int, lamb: float, dtype=None) -> optax.GradientTransformation:
  """g + lamb * (the mean of the last `window` gradients, this one included),
  once `window` gradients have been seen; g unchanged before, held in
  `dtype` (None: the params').

  A ring buffer with a running sum: each step writes one slot and reads one,
  whatever the window (the window as `window` trees, each rewritten and
  summed every step, cost 2.3x the step at window 100). The slot a gradient
  replaces is read in the step before, after that step's write: read in the
  same step as the write, XLA copies the whole window to keep the read's
  value. The sum is recomputed from the slots each time the ring comes
  round, so rounding in the running sum never outlives one window
  (gradients that shrink by orders of magnitude over training would
  otherwise leave the early ones' rounding in it)."""

  def init(params):  # each tree its own arrays: the step donates them all
    return MaState(
      jnp.zeros((), jnp.int32),
      _zeros(params, dtype, (window,)),
      _zeros(params, dtype),
      _zeros(params, dtype),
    )

  def update(grads, state, params=None):
    del params
    at = state.count % window
    slots = jax.tree.map(
      lambda b, g: lax.dynamic_update_index_in_dim(b, g.astype(b.dtype), at, 0),
      state.window,
      grads,
    )
    total = lax.cond(
      at == window - 1,  # the ring's last slot: sum the window afresh
      lambda: jax.tree.map(lambda b: b.sum(0), slots),
      lambda: jax.tree.map(
        lambda t, o, g: t - o + g.astype(t.dtype), state.total, state.leaving, grads
      ),
    )
    nxt = (at + 1) % window
    leaving = jax.tree.map(
      lambda b: lax.dynamic_index_in_dim(b, nxt, keepdims=False), slots
    )
    lamb_now = jnp.where(state.count + 1 >= window, lamb, 0.0)  # 0: warm-up
    out = jax.tree.map(
      lambda g, t: (g + lamb_now * (t / window)).astype(g.dtype), grads, total
    )
    count = optax.safe_increment(state.count)
    return out, MaState(count, slots, total, leaving)

  return optax.GradientTransformation(init, update)


def perp_grad() -> optax.GradientTransformation:
  """Each gradient without its projection on its weight (the whole tensor's
  inner product), rescaled to the gradient's own norm. The products are
  reduced in place (`jnp.sum(w * g)`), so a sharded tensor stays sharded: a
  partial sum per device and one all-reduce (`jnp.vdot` flattens it first,
  which XLA may only do by gathering it)."""

  def one(g, w):
    g32, w32 = g.astype(jnp.float32), w.astype(jnp.float32)
    orth = g32 - (jnp.sum(w32 * g32) / (jnp.sum(w32 * w32) + 1e-30)) * w32
    norm = lambda x: jnp.sqrt(jnp.sum(x * x))  # noqa: E731
    scale = norm(g32) / (norm(orth) + 1e-30)
    return (orth * scale).astype(g.dtype)

  def update(grads, state, params=None):
    if params is None:
      raise ValueError("perp_grad needs the params: tx.update(grads, state, params)")
    return jax.tree.map(one, grads, params), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def make(tc) -> list[optax.GradientTransformation]:
  """The transformations `train` (a config section) asks for, in order:
  perp-Grad on the raw gradient, then the Grokfast filter."""
  out = [perp_grad()] if tc.perp_grad else []
  g = tc.grokfast
  dtype = None if g.state_dtype == "params" else g.state_dtype
  if g.kind == "ema":
    out.append(grokfast_ema(g.alpha, g.lamb, dtype))
  elif g.kind == "ma":
    out.append(grokfast_ma(g.window, g.lamb, dtype))
  return out


def state_bytes(tc, param_bytes: int = 4) -> int:
  """Bytes the Grokfast filter of `tc` (a train section) holds per parameter
  (`param_bytes`: a parameter's own, for state_dtype "params"): the EMA one
  value, the MA its window, their sum and the slot the next gradient
  replaces (`footprint.py` counts them)."""
  g = tc.grokfast
  if g.kind == "none":
    return 0
  width = (
    param_bytes if g.state_dtype == "params" else jnp.dtype(g.state_dtype).itemsize
  )
  return width * (1 if g.kind == "ema" else g.window + 2)
