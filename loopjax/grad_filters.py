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

The filters' state is params-shaped trees (the MA window: one tree per slot),
so it is sharded like the params (`sharding.state_shardings`), saved in the
checkpoint, and reset with the optimizer (a curriculum stage's fresh one).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class EmaState(NamedTuple):
  count: jax.Array  # gradients seen (int32)
  mu: optax.Updates


def grokfast_ema(alpha: float, lamb: float) -> optax.GradientTransformation:
  """g + lamb * mu, mu the EMA of the gradients with decay `alpha`."""

  def init(params):
    return EmaState(jnp.zeros((), jnp.int32), optax.tree.zeros_like(params))

  def update(grads, state, params=None):
    del params
    first = state.count == 0
    mu = jax.tree.map(
      lambda m, g: jnp.where(first, g, alpha * m + (1 - alpha) * g), state.mu, grads
    )
    out = jax.tree.map(lambda g, m: g + lamb * m, grads, mu)
    return out, EmaState(optax.safe_increment(state.count), mu)

  return optax.GradientTransformation(init, update)


class MaState(NamedTuple):
  count: jax.Array  # gradients seen (int32)
  window: tuple  # the last `len(window)` gradients, slot count % len


def grokfast_ma(window: int, lamb: float) -> optax.GradientTransformation:
  """g + lamb * (the mean of the last `window` gradients, this one included),
  once `window` gradients have been seen; g unchanged before."""

  def init(params):
    slots = tuple(optax.tree.zeros_like(params) for _ in range(window))
    return MaState(jnp.zeros((), jnp.int32), slots)

  def update(grads, state, params=None):
    del params
    at = state.count % window
    slots = tuple(
      jax.tree.map(lambda s, g, i=i: jnp.where(at == i, g, s), slot, grads)
      for i, slot in enumerate(state.window)
    )
    full = state.count + 1 >= window
    mean = jax.tree.map(lambda *s: sum(s) / window, *slots)
    out = jax.tree.map(lambda g, m: g + jnp.where(full, lamb, 0.0) * m, grads, mean)
    return out, MaState(optax.safe_increment(state.count), slots)

  return optax.GradientTransformation(init, update)


def perp_grad() -> optax.GradientTransformation:
  """Each gradient without its projection on its weight (the whole tensor
  flattened), rescaled to the gradient's own norm."""

  def one(g, w):
    g32, w32 = g.astype(jnp.float32), w.astype(jnp.float32)
    orth = g32 - (jnp.vdot(w32, g32) / (jnp.vdot(w32, w32) + 1e-30)) * w32
    scale = jnp.linalg.norm(g32) / (jnp.linalg.norm(orth) + 1e-30)
    return (orth * scale).astype(g.dtype)

  def update(grads, state, params):
    if params is None:
      raise ValueError("perp_grad needs the params")
    return jax.tree.map(one, grads, params), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def make(tc) -> list[optax.GradientTransformation]:
  """The transformations `train` (a config section) asks for, in order:
  perp-Grad on the raw gradient, then the Grokfast filter."""
  out = [perp_grad()] if tc.perp_grad else []
  g = tc.grokfast
  if g.kind == "ema":
    out.append(grokfast_ema(g.alpha, g.lamb))
  elif g.kind == "ma":
    out.append(grokfast_ma(g.window, g.lamb))
  return out
