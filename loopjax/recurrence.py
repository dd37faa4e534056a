"""How the shared core is iterated: the functional core of recurrent depth.

`unroll` runs a fixed number of iterations with `lax.scan`, so the compiled
program holds one group of iterations whatever R is. A sampled depth is a
traced scalar: the scan runs to R_max and leaves the state as it is past
the depth, so no value of it recompiles. `past_depth` says how: "skip" (a
`lax.cond` per iteration: the iterations past the depth run neither forward
nor backward) or "mask" (`jnp.where(r < depth, step(h), h)`: computed and
discarded). On XLA:CPU skipping is 1.7x faster at Poisson(4) in [2, 8]; for
a TPU slice it compiles to 4x the memory and 9x the all-reduces
(docs/performance.md), so "auto" skips on CPU only.
`sample_depth` draws it per batch (Poisson, or Huginn's log-normal Poisson).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from loopjax import sharding

REMAT_POLICIES = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def group_size(num_loops: int, scan_unroll: int) -> int:
  """The largest divisor of `num_loops` that is at most `scan_unroll`."""
  limit = max(1, min(scan_unroll, num_loops))
  return max(k for k in range(1, limit + 1) if num_loops % k == 0)


def unroll(
  step: Callable,
  h,
  num_loops: int,
  *,
  remat: str = "none",
  scan_unroll: int = 1,
  readout: Callable | None = None,
  depth=None,
  grad_depth: int = 0,
  past_depth: str = "auto",
):
  """Applies `step` `num_loops` times, or `depth` (a traced int, <= num_loops).

  Returns the final state and, if `readout` is given, `readout(h_r)` after
  every iteration stacked on a leading axis of size `num_loops` (else None);
  past `depth` the state stays put, so its readouts repeat the last one.
  `grad_depth` > 0 truncates backprop: gradients flow through the last
  `grad_depth` applied iterations only (the state entering them is a constant).

  The scan steps over groups of `group_size(num_loops, scan_unroll)` iterations
  unrolled in its body. On CPU a short unrolled loop trains ~25% faster than a
  rolled one, whose saved residuals go through stacked buffers allocated and
  zeroed every step; compile time grows with the group, not with R. `remat`
  (a policy in REMAT_POLICIES, or "none") rematerializes each iteration in its
  own backward pass, and the scan then steps one iteration at a time
  (`scan_unroll` is ignored): a rematerialized group of k iterations is
  recomputed whole, k iterations' activations at once (`lm.py:gpu` on an
  H200: 3.6 GiB of temporaries per GPU with its 4 iterations in one group,
  1.6 GiB one at a time), and unrolled checkpoints let the scheduler do the
  same.
  """
  k = 1 if remat != "none" else group_size(num_loops, scan_unroll)
  skip = past_depth == "skip" or (past_depth == "auto" and sharding.platform() == "cpu")
  stop_at = (
    None if grad_depth <= 0 else (num_loops if depth is None else depth) - grad_depth
  )

  def one(h, r):
    if stop_at is not None:  # the state entering the last grad_depth iterations;
      cut = (r == stop_at) & (stop_at > 0)  # never h_0: all iterations then
      h = jnp.where(cut, jax.lax.stop_gradient(h), h)
    if depth is None:
      return step(h)
    if skip:
      return jax.lax.cond(r < depth, step, lambda h: h, h)
    return jnp.where(r < depth, step(h), h)

  def group(carry, _):
    h, r = carry
    ys = []
    for i in range(k):
      h = one(h, r + i)
      if readout is not None:
        ys.append(readout(h))
    return (h, r + k), (jax.tree.map(lambda *y: jnp.stack(y), *ys) if ys else None)

  if remat != "none":  # CSE is harmless inside a scan, but would undo remat outside
    group = jax.checkpoint(
      group, policy=REMAT_POLICIES[remat], prevent_cse=k == num_loops
    )
  r0 = jnp.zeros((), jnp.int32)
  if k == num_loops:  # one group: no loop at all
    (h, _), ys = group((h, r0), None)
    ys = jax.tree.map(lambda y: y[None], ys)
  else:
    (h, _), ys = jax.lax.scan(group, (h, r0), None, length=num_loops // k)
  if ys is not None:
    ys = jax.tree.map(lambda y: y.reshape(num_loops, *y.shape[2:]), ys)
  return h, ys


def sample_depth(key, dist: str, mean: float, lo: int, hi: int, sigma: float = 0.5):
  """A depth for one batch, clipped to [lo, hi], as a traced int32 scalar.

  "poisson": Poisson(mean). "lognormal_poisson" (Huginn, Geiping et al. 2025):
  tau ~ Normal(log(mean) - sigma^2 / 2, sigma), depth = Poisson(e^tau) + 1, a
  heavy-tailed draw whose mean is about mean + 1.
  """
  if dist == "poisson":
    d = jax.random.poisson(key, mean)
  else:
    k_tau, k_r = jax.random.split(key)
    tau = jnp.log(mean) - sigma**2 / 2 + sigma * jax.random.normal(k_tau)
    d = jax.random.poisson(k_r, jnp.exp(tau)) + 1
  return jnp.clip(d, lo, hi).astype(jnp.int32)
