"""The grokking accelerators: Grokfast's filters, perp-Grad and StableMax
against their papers' formulas (NumPy, a few steps by hand); config fields
checked; a run with all of them resumes bit for bit; their state sharded like
the params; a curriculum's fresh optimizer starts a fresh filter."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import losses

from loopjax import config as config_lib
from loopjax import data, grad_filters, loss, sharding, train
from loopjax.errors import ConfigError
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


def test_grokfast_ma_adds_the_windows_mean_once_it_is_full():
  w, lamb = 3, 0.5
  got = run(grad_filters.grokfast_ma(w, lamb))
  for t, (g, u) in enumerate(zip(GRADS, got, strict=True)):
    for k in g:
      if t + 1 < w:  # warm-up: the gradient as it is
        np.testing.assert_allclose(u[k], g[k], rtol=1e-6)
      else:
        mean = np.mean([GRADS[s][k] for s in range(t + 1 - w, t + 1)], axis=0)
        np.testing.assert_allclose(u[k], g[k] + lamb * mean, rtol=1e-6)


def test_perp_grad_removes_the_component_along_each_weight():
  """g - (w.g / w.w) w, per tensor, rescaled to |g|: orthogonal to w, same norm."""
  (u,) = run(grad_filters.perp_grad(), GRADS[:1])
  for k, g in GRADS[0].items():
    w = PARAMS[k]
    orth = g - (np.vdot(w, g) / np.vdot(w, w)) * w
    want = orth * np.linalg.norm(g) / np.linalg.norm(orth)
    np.testing.assert_allclose(u[k], want, rtol=1e-5)
    assert abs(np.vdot(u[k], w)) < 1e-5 * np.linalg.norm(g) * np.linalg.norm(w)


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
  task = data.knowledge_graph(c.data)
  _, _, _, shardings = sharded_train_state(c, task, mesh, abstract=True)
  filt = shardings["opt_state"][1]  # chain: perp-Grad, the filter, clip, adamw
  trees = [filt.mu] if kind == "ema" else list(filt.window)
  for tree in trees:
    assert jax.tree.map(lambda s: s.spec, tree) == jax.tree.map(
      lambda s: s.spec, shardings["params"]
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
