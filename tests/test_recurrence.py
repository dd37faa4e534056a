"""Iteration regimes: masked (sampled) depth, truncated backprop, depth sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopjax import recurrence
from loopjax.kg import source as kg_source

D = 8
W = jax.random.normal(jax.random.key(0), (D, D)) / np.sqrt(D)


def step(h):
  return jnp.tanh(h @ W + 0.1)


H0 = jax.random.normal(jax.random.key(1), (3, D))


@pytest.mark.parametrize("scan_unroll", [2, 6])  # a scan of 3 groups; no scan
@pytest.mark.parametrize("d", [1, 3, 6])
def test_masked_depth_equals_fixed_depth(scan_unroll, d):
  kw = dict(scan_unroll=scan_unroll, readout=lambda h: h.sum(-1))
  h_m, ys_m = recurrence.unroll(step, H0, 6, depth=jnp.int32(d), **kw)
  h_f, ys_f = recurrence.unroll(step, H0, d, **kw)
  np.testing.assert_allclose(h_m, h_f, rtol=1e-6)
  np.testing.assert_allclose(ys_m[:d], ys_f, rtol=1e-6)
  np.testing.assert_allclose(ys_m[d:], np.broadcast_to(ys_f[-1], ys_m[d:].shape))


def test_sampled_depth_compiles_once():
  traces = []

  @jax.jit
  def f(h, depth):
    traces.append(1)
    return recurrence.unroll(step, h, 8, depth=depth, scan_unroll=4)[0]

  outs = [f(H0, jnp.int32(d)) for d in (2, 3, 5, 8)]
  assert len(traces) == 1
  np.testing.assert_allclose(outs[1], recurrence.unroll(step, H0, 3)[0], rtol=1e-6)


@pytest.mark.parametrize(
  "past_depth,platform,skips",
  [
    ("skip", "tpu", True),
    ("mask", "cpu", False),
    ("auto", "cpu", True),
    ("auto", "tpu", False),
  ],
)
def test_iterations_past_the_sampled_depth_are_skipped_or_masked(
  past_depth, platform, skips, monkeypatch
):
  """A step that counts its own backward runs: at depth 3 of 8, skipping runs
  3 (the iterations past it cost nothing) and masking all 8 (computed and
  discarded); both give fixed R = 3's value and gradient. `auto` skips when
  compiling for CPU only."""
  monkeypatch.setattr(recurrence.sharding, "platform", lambda: platform)
  runs = []

  @jax.custom_vjp
  def counted(h):
    return step(h)

  def counted_bwd(h, g):
    jax.debug.callback(lambda: runs.append(1))
    return jax.vjp(step, h)[1](g)

  counted.defvjp(lambda h: (step(h), h), counted_bwd)

  def final(h, depth):
    h, _ = recurrence.unroll(counted, h, 8, depth=depth, past_depth=past_depth)
    return h.sum()

  value, grad = jax.jit(jax.value_and_grad(final))(H0, jnp.int32(3))
  jax.effects_barrier()
  assert len(runs) == (3 if skips else 8)
  want, want_grad = jax.value_and_grad(
    lambda h: recurrence.unroll(step, h, 3)[0].sum()
  )(H0)
  np.testing.assert_allclose(value, want, rtol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_truncated_backprop_counts_only_the_last_k_iterations(masked, k):
  """h_{r+1} = w h_r from h_0 = 1: h_5 = w^5. With the state entering the last
  k iterations held constant, dh_5/dw = k w^4 (k = 5: all of them)."""
  w0, d = 1.3, 5

  def final(w):
    depth = jnp.int32(d) if masked else None
    loops = 7 if masked else d
    h, _ = recurrence.unroll(
      lambda h: w * h, jnp.ones(()), loops, depth=depth, grad_depth=k, scan_unroll=2
    )
    return h

  np.testing.assert_allclose(final(w0), w0**d, rtol=1e-6)
  np.testing.assert_allclose(jax.grad(final)(w0), k * w0 ** (d - 1), rtol=1e-5)


@pytest.mark.parametrize("k,expected", [(2, 0.0), (5, 1.3**5), (9, 1.3**5)])
def test_truncation_reaches_the_input_only_when_k_covers_every_iteration(k, expected):
  def final(h0):
    return recurrence.unroll(lambda h: 1.3 * h, h0, 5, grad_depth=k)[0]

  np.testing.assert_allclose(jax.grad(final)(1.0), expected, rtol=1e-5)


@pytest.mark.parametrize("dist", ["poisson", "lognormal_poisson"])
def test_sampled_depths_follow_their_distribution(dist):
  keys = jax.random.split(jax.random.key(0), 4000)
  draw = jax.vmap(lambda k: recurrence.sample_depth(k, dist, 4.0, 2, 8, 0.5))
  depths = np.asarray(draw(keys))
  assert depths.dtype == np.int32 and depths.min() >= 2 and depths.max() <= 8
  rng = np.random.default_rng(0)  # the same law, drawn by numpy
  if dist == "poisson":
    ref = rng.poisson(4.0, 100_000)
  else:
    tau = rng.normal(np.log(4.0) - 0.125, 0.5, 100_000)
    ref = rng.poisson(np.exp(tau)) + 1
  ref = np.clip(ref, 2, 8)
  assert abs(depths.mean() - ref.mean()) < 0.1
  for v in range(2, 9):  # every depth in range shows up about as often
    assert abs((depths == v).mean() - (ref == v).mean()) < 0.03


def test_dynamic_depth_training_step(tiny_config):
  from loopjax import train
  from loopjax.data import pipeline
  from loopjax.state import build_model, init_state, make_optimizer

  tiny_config.train.depth.update(dist="poisson", mean=3.0, min=1, max=6)
  tiny_config.train.backprop_depth = 2
  tiny_config.model.injection = "add"
  task = kg_source.knowledge_graph(tiny_config.data)
  model = build_model(tiny_config.model, task.vocab.vocab_size, 3, 0)
  tx = make_optimizer(tiny_config.train)
  graphdef, state = init_state(model, tx, 0)
  step = train.make_train_step(tiny_config, graphdef, tx)
  it = pipeline.train_iterator(task.splits["train"], 64, 0, task.vocab.pad_id)
  depths = []
  for _ in range(12):
    state, out = step(state, next(it))
    depths.append(int(out["train/depth"]))
  assert step._cache_size() == 1  # one program for every sampled depth
  assert min(depths) >= 1 and max(depths) <= 6 and len(set(depths)) > 1
