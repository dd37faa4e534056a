"""The grokking accelerators: Grokfast's filters, perp-Grad and StableMax
against their papers' formulas (NumPy, a few steps by hand); config fields
checked; a run with all of them resumes bit for bit; their state sharded like
the params; a curriculum's fresh optimizer starts a fresh filter."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import losses

from loopjax import compiled, grad_filters, loss, sharding, train
from loopjax import config as config_lib
from loopjax.errors import ConfigError
from loopjax.kg import source as kg_source
from loopjax.state import make_optimizer, sharded_train_state

RNG = np.random.default_rng(0)


def tree():
  return {
    k: RNG.normal(size=s).astype(np.float32) for k, s in (("w", (3, 2)), ("b", (2,)))
  }


GRADS = [tree() for _ in range(4)]
PARAMS = tree()


def run(tx, grads=GRADS, params=PARAMS):
  state, out = tx.init(params), []
  for g in grads:
    u, state = tx.update(g, state, params)
    out.append(jax.tree.map(np.asarray, u))
  return out


def test_grokfast_ema_is_the_papers_filter():
  """mu_1 = g_1 (the paper's code starts the average at the first
  gradient), mu_t = alpha mu_{t-1} + (1 - alpha) g_t; g'_t = g_t + lamb mu_t."""
  alpha, lamb = 0.9, 2.0
  got = run(grad_filters.grokfast_ema(alpha, lamb))
  mu = None
  for g, u in zip(GRADS, got, strict=True):
    mu = dict(g) if mu is None else {k: alpha * mu[k] + (1 - alpha) * g[k] for k in g}
    for k in g:
      np.testing.assert_allclose(u[k], g[k] + lamb * mu[k], rtol=1e-6)


@pytest.mark.parametrize("w", [1, 3])
def test_grokfast_ma_adds_the_windows_mean_once_it_is_full(w):
  """The paper's mean of the last `window` gradients with the ring round
  three times, and the gradient as it is before the window is full (the
  warm-up, as before the ring buffer). A spike 1e6 times the others leaves
  its rounding in the running sum once it leaves the window, until the ring
  comes round and the sum is taken afresh."""
  lamb = 0.5
  grads = [tree() for _ in range(3 * w + 4)]
  grads[1] = jax.tree.map(lambda g: g * 1e6, grads[1])
  got = run(grad_filters.grokfast_ma(w, lamb), grads)
  resum = next(t for t in range(1 + w, len(grads)) if t % w == w - 1)
  for t, (g, u) in enumerate(zip(grads, got, strict=True)):
    for k in g:
      if t + 1 < w:  # warm-up: the gradient as it is
        np.testing.assert_array_equal(u[k], g[k])
        continue
      mean = np.mean([grads[s][k] for s in range(t + 1 - w, t + 1)], axis=0)
      rounding = 1.0 if 1 + w <= t < resum else 1e-6
      np.testing.assert_allclose(u[k], g[k] + lamb * mean, rtol=1e-5, atol=rounding)


def test_grokfast_ma_costs_the_same_whatever_its_window():
  """A ring buffer: the update's program (its jaxpr) is the same size at
  window 2 and 100 (the window as a tuple of trees, each rewritten and summed
  every step, grew with it: 2.3x the step time at 100), and compiled it
  copies no window (XLA copies the buffer when a step reads the slot it
  writes: the slot to replace is read in the step before)."""
  params = {"w": jnp.zeros((64, 64)), "b": jnp.zeros((64,))}

  def program(window):
    tx = grad_filters.grokfast_ma(window, 5.0)
    return jax.make_jaxpr(tx.update)(params, tx.init(params))

  assert len(program(100).eqns) == len(program(2).eqns)
  tx = grad_filters.grokfast_ma(100, 5.0)
  step = jax.jit(tx.update, donate_argnums=1).lower(params, tx.init(params)).compile()
  window_bytes = 100 * 4 * (64 * 64 + 64)
  assert compiled.memory(step)["temporaries"] < window_bytes / 10
  step(params, tx.init(params))  # its state donated, each array once


def test_perp_grad_removes_the_component_along_each_weight():
  """g - (w.g / w.w) w, per tensor, rescaled to |g|: orthogonal to w, same norm."""
  (u,) = run(grad_filters.perp_grad(), GRADS[:1])
  for k, g in GRADS[0].items():
    w = PARAMS[k]
    orth = g - (np.vdot(w, g) / np.vdot(w, w)) * w
    want = orth * np.linalg.norm(g) / np.linalg.norm(orth)
    np.testing.assert_allclose(u[k], want, rtol=1e-5)
    assert abs(np.vdot(u[k], w)) < 1e-5 * np.linalg.norm(g) * np.linalg.norm(w)


def test_perp_grad_without_params_says_so():
  tx = grad_filters.perp_grad()
  with pytest.raises(ValueError, match="perp_grad needs the params"):
    tx.update(GRADS[0], tx.init(PARAMS))


def test_perp_grad_keeps_a_sharded_weight_sharded():
  """A weight split over both axes of a 2 x 4 mesh: each device reduces its
  shard and all-reduces sum them; nothing is gathered (`jnp.vdot` flattened
  the tensor first, and XLA all-gathered it to do so)."""
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
  tx = grad_filters.perp_grad()

  def update(g, w):
    return tx.update({"w": g}, optax.EmptyState(), {"w": w})[0]["w"]

  g, w = (
    jax.device_put(RNG.normal(size=(16, 32)).astype(np.float32), split) for _ in "gw"
  )
  program = jax.jit(update).lower(g, w).compile()
  assert set(compiled.collectives(program.as_text())) == {"all-reduce"}
  assert program(g, w).sharding == split


def test_a_bfloat16_models_filter_state_is_float32_unless_asked():
  """The default state_dtype keeps the EMA in float32 and it follows the
  formula; "params" holds it in bfloat16, where alpha 0.999's 0.1% share of
  each new gradient is lost to rounding (the average never moves)."""
  c = config_lib.base()
  c.train.grokfast.update(kind="ema", alpha=0.999, lamb=1.0)
  params = {"w": jnp.ones((4,), jnp.bfloat16)}
  grads = [jnp.full((4,), v, jnp.bfloat16) for v in [1.0] + [2.0] * 100]
  mu = {}
  for dtype in ("float32", "params"):
    c.train.grokfast.state_dtype = dtype
    (tx,) = grad_filters.make(c.train)
    state = tx.init(params)
    for g in grads:
      out, state = tx.update({"w": g}, state, params)
    assert out["w"].dtype == jnp.bfloat16
    mu[dtype] = state.mu["w"]
  want = 2.0 - 0.999**100  # mu_1 = 1, then 100 steps toward 2
  assert mu["float32"].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(mu["float32"]), want, rtol=1e-5)
  assert mu["params"].dtype == jnp.bfloat16 and float(mu["params"][0]) == 1.0


# ~25-40 s: the train step compiled (XLA:CPU).
@pytest.mark.slow
def test_the_filters_state_is_counted_before_compiling(tiny_config):
  """Grokfast MA at window 100 holds 25x the rest of the train state: the
  pre-compile bound counts it and is then within 2x of the compiled step's
  peak (footprint.py's docstring), and never above it."""
  from loopjax import footprint, passes
  from loopjax import task as task_lib

  c = tiny_config
  c.train.grokfast.update(kind="ma", window=100)
  c.mesh.update(data=1, devices=1)
  c.eval_every = 0
  family = task_lib.for_config(c)
  task = family.without_examples(c)
  mesh = sharding.run_mesh(c, jax.devices()[:1]).mesh
  bound = sum(footprint.lower_bound(c, family, task, mesh).values())
  peak = passes.check(c, jax.devices()[:1], only=["train"])["memory"]["peak"]
  assert bound <= peak <= 2 * bound, (bound, peak)


def test_stablemax_cross_entropy_is_the_papers_formula():
  """-log(s(x_t) / sum s(x)), s(x) = x + 1 (x >= 0), 1 / (1 - x) (x < 0); a
  confident answer's loss and gradient stay finite and nonzero where
  softmax's reach float32's floor (its softmax collapse)."""
  x = RNG.normal(size=(5, 7)) * 3
  t = RNG.integers(0, 7, 5)
  s = np.where(x >= 0, x + 1, 1 / (1 - np.minimum(x, 0)))
  want = -np.log(s[np.arange(5), t] / s.sum(-1))
  got = loss.answer_xent(jnp.asarray(x), jnp.asarray(t), 0.0, "stablemax")
  np.testing.assert_allclose(got, want, rtol=1e-5)
  sure = jnp.asarray([[200.0, -200.0, 0.0]], jnp.float32)
  for xent, collapses in (("softmax", True), ("stablemax", False)):
    f = lambda z, xent=xent: loss.answer_xent(z, jnp.asarray([0]), 0.0, xent).sum()  # noqa: E731
    value, grad = jax.value_and_grad(f)(sure)
    assert (float(value) == 0.0 and not np.any(grad)) == collapses, xent


@pytest.mark.parametrize(
  "field, value, says",
  [
    (
      "train.grokfast.kind",
      "fast",
      "train.grokfast.kind: must be one of none, ema, ma",
    ),
    ("train.grokfast.alpha", 1.0, "train.grokfast.alpha: must be in [0, 1)"),
    ("train.grokfast.lamb", -1.0, "train.grokfast.lamb: must be >= 0"),
    ("train.grokfast.window", 0, "train.grokfast.window: must be >= 1"),
    (
      "train.grokfast.state_dtype",
      "bfloat16",
      "train.grokfast.state_dtype: must be one of float32, params",
    ),
    ("train.xent", "sparsemax", "train.xent: must be one of softmax, stablemax"),
  ],
)
def test_bad_accelerator_fields_are_one_line(tiny_config, field, value, says):
  section, name = field.rsplit(".", 1)
  node = tiny_config
  for part in section.split("."):
    node = node[part]
  node[name] = value
  with pytest.raises(ConfigError, match=r"^" + re.escape(says)):
    config_lib.validate(tiny_config)


def test_a_language_model_refuses_stablemax():
  from experiments import lm

  c = lm.get_config("tiny")
  c.train.xent = "stablemax"
  with pytest.raises(ConfigError, match="train.xent: must be 'softmax' for data.task"):
    config_lib.validate(c)


def accelerated(c):
  c.train.grokfast.update(kind="ema", alpha=0.9, lamb=1.0)
  c.train.update(perp_grad=True, xent="stablemax")
  return c


@pytest.mark.slow  # ~15 s: four runs
def test_a_run_with_every_accelerator_resumes_bit_for_bit(tiny_config, tmp_path):
  """The filter's state is in the checkpoint: stopped at 20 and resumed, the
  run logs the losses of one that never stopped; and it is not the plain
  run (the accelerators act)."""
  c = accelerated(tiny_config)
  c.train.num_steps, c.eval_every = 40, 0
  train.train_and_evaluate(c, tmp_path / "straight")
  c.train.num_steps = 20
  train.train_and_evaluate(c, tmp_path / "resumed")
  c.train.num_steps = 40
  train.train_and_evaluate(c, tmp_path / "resumed")
  straight = losses(tmp_path / "straight")
  assert straight == losses(tmp_path / "resumed")
  c.train.update(perp_grad=False, xent="softmax")
  c.train.grokfast.kind = "none"
  train.train_and_evaluate(c, tmp_path / "plain")
  assert losses(tmp_path / "plain")[40] != straight[40]


@pytest.mark.parametrize("kind", ["ema", "ma"])
def test_the_filters_state_is_sharded_like_the_params(tiny_config, kind):
  """On a data 2 x fsdp 2 x tensor 2 mesh of the 8 CPU devices."""
  c = accelerated(tiny_config)
  c.train.grokfast.update(kind=kind, window=2)
  c.mesh.update(data=2, fsdp=2, tensor=2, devices=0)
  mesh = sharding.make_mesh(c.mesh)
  task = kg_source.knowledge_graph(c.data)
  _, _, _, shardings = sharded_train_state(c, task, mesh, abstract=True)
  filt = shardings["opt_state"][1]  # chain: perp-Grad, the filter, clip, adamw
  specs = lambda t: jax.tree.map(lambda s: tuple(s.spec), t)  # noqa: E731
  like = specs(shardings["params"])
  trees = [filt.mu] if kind == "ema" else [filt.total, filt.leaving]
  for tree in trees:
    assert specs(tree) == like
  if kind == "ma":  # the window's axis whole, each slot like its param
    assert specs(filt.window) == jax.tree.map(
      lambda s: (None, *s), like, is_leaf=lambda s: isinstance(s, tuple)
    )
  assert filt.count.spec == jax.sharding.PartitionSpec()
  wqkv = shardings["params"]["core"][0]["attn"]["wqkv"].spec
  assert wqkv != jax.sharding.PartitionSpec()  # a sharded param, so the test bites


def test_a_curriculum_stages_fresh_optimizer_starts_a_fresh_filter():
  from experiments import extrapolation
  from loopjax.kg import curriculum

  c = accelerated(extrapolation.get_config("tiny"))
  c.train.curriculum.reset_optimizer = True
  tx = make_optimizer(c.train)
  params = {"w": jnp.ones((2, 2))}
  state = {"params": params, "opt_state": tx.init(params), "stage": jnp.int32(2)}
  _, state["opt_state"] = tx.update(
    {"w": jnp.asarray([[3.0, 0.0], [0.0, 1.0]])}, state["opt_state"], params
  )
  ema = lambda s: s["opt_state"][0][1]  # noqa: E731
  assert int(ema(state).count) == 1 and float(ema(state).mu["w"][0, 0]) != 0
  fresh = curriculum.enter(state, 3, tx, c)
  assert int(ema(fresh).count) == 0 and not np.any(ema(fresh).mu["w"])


def test_the_chain_is_unchanged_without_accelerators(tiny_config):
  """No accelerator: the optimizer state has its old structure, so runs
  started before these fields existed resume."""
  state = make_optimizer(tiny_config.train).init(PARAMS)
  assert len(state) == 2  # clip, adamw
