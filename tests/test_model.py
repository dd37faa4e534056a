"""Model: shapes, causality, scan == Python unroll, remat keeps gradients."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from loopjax import config as config_lib
from loopjax.state import build_model

V, T, B = 23, 5, 3


def model_cfg(**kw):
  c = config_lib.base().model
  c.update({"d_model": 16, "num_heads": 2, "num_loops": 3, **kw})
  return c


def inputs(seed=0):
  rng = np.random.default_rng(seed)
  tokens_BT = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  return tokens_BT, jnp.array([4, 2, 0], jnp.int32)


VARIANTS = [
  dict(
    injection=i,
    norm_position=p,
    norm_type=n,
    init_state=s,
    pos_encoding=e,
    tie_embeddings=tie,
    num_prelude=pre,
    num_coda=coda,
  )
  for (i, s), p, n, e, tie, (pre, coda) in itertools.product(
    [("none", "embedding"), ("add", "zeros"), ("concat", "random")],
    ["pre", "sandwich", "post"],
    ["layernorm", "rmsnorm"],
    ["learned", "sinusoidal", "rope", "none"],
    [True, False],
    [(0, 0), (1, 1)],
  )
][::7]  # a spread over the product, not all 288


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(map(str, kw.values())))
def test_shapes_and_per_iteration_readout(kw):
  model = build_model(model_cfg(**kw), V, T, seed=0)
  tokens_BT, pos_B = inputs()
  key = jax.random.key(1)
  logits_BV, logits_RBV = model(tokens_BT, pos_B, per_iteration=True, key=key)
  assert logits_BV.shape == (B, V) and logits_RBV.shape == (3, B, V)
  np.testing.assert_allclose(logits_RBV[-1], logits_BV, atol=1e-5)
  assert jnp.isfinite(logits_BV).all()


def test_causal():
  """Logits at position t do not change when tokens after t change."""
  model = build_model(model_cfg(injection="add", num_prelude=1, num_coda=1), V, T, 0)
  tokens_BT, _ = inputs()
  pos_B = jnp.full((B,), 2, jnp.int32)
  changed_BT = tokens_BT.at[:, 3:].set((tokens_BT[:, 3:] + 1) % V)
  np.testing.assert_allclose(
    model(tokens_BT, pos_B), model(changed_BT, pos_B), atol=1e-6
  )
  changed_BT = tokens_BT.at[:, 2].set((tokens_BT[:, 2] + 1) % V)
  assert not np.allclose(model(tokens_BT, pos_B), model(changed_BT, pos_B))


def test_weights_are_shared_across_iterations():
  """Parameter count does not grow with R, and R changes the output."""
  count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  m3, m9 = (
    build_model(model_cfg(), V, T, 0),
    build_model(model_cfg(num_loops=9), V, T, 0),
  )
  assert count(m3) == count(m9)
  tokens_BT, pos_B = inputs()
  assert not np.allclose(m3(tokens_BT, pos_B), m9(tokens_BT, pos_B))


@pytest.mark.parametrize(
  "injection,scan_unroll", [("none", 1), ("add", 2), ("concat", 8)]
)
def test_scan_equals_python_unroll(injection, scan_unroll):
  """A rolled, partly or fully unrolled scan all equal a Python loop (R = 3)."""
  init_state = "embedding" if injection == "none" else "zeros"
  model = build_model(
    model_cfg(
      injection=injection,
      init_state=init_state,
      num_layers=2,
      num_prelude=1,
      num_coda=1,
      scan_unroll=scan_unroll,
    ),
    V,
    T,
    0,
  )
  tokens_BT, pos_B = inputs()
  x_BTD = model.prelude[0](model.embed_tokens(tokens_BT))
  h_BTD = model.initial_state(x_BTD, None)
  for _ in range(3):
    h_BTD = model.core_step(h_BTD, x_BTD)
  np.testing.assert_allclose(
    model(tokens_BT, pos_B), model.readout(h_BTD, pos_B), rtol=1e-5, atol=1e-5
  )


@pytest.mark.parametrize("policy,scan_unroll", [("full", 1), ("dots", 2), ("full", 4)])
def test_remat_gives_equal_gradients(policy, scan_unroll):
  """Rematerializing groups of 1, 2 or 4 iterations keeps the gradients."""
  tokens_BT, pos_B = inputs()

  def grads(remat, scan_unroll=1):
    cfg = model_cfg(remat=remat, num_loops=4, scan_unroll=scan_unroll)
    model = build_model(cfg, V, T, 0)
    graphdef, params = nnx.split(model, nnx.Param)
    loss = lambda p: jnp.square(nnx.merge(graphdef, p)(tokens_BT, pos_B)).mean()
    return jax.jit(jax.grad(loss))(params)

  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
    grads("none"),
    grads(policy, scan_unroll),
  )


def test_every_parameter_has_logical_axes():
  model = build_model(
    model_cfg(
      injection="concat",
      init_state="random",
      num_prelude=1,
      num_coda=1,
      tie_embeddings=False,
      norm_position="sandwich",
    ),
    V,
    T,
    0,
  )
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names = var.get_metadata().get("out_sharding")
    assert names is not None and len(names) == var.get_value().ndim, path


def test_rope_scores_depend_on_relative_position_only():
  """q.k after rotary embedding is the same for any common shift of both."""
  from loopjax.model.layers import rope

  q, k = jax.random.normal(jax.random.key(1), (2, 1, 1, 1, 8))
  pad = jnp.zeros((1, 11, 1, 8))

  def score(i, j):  # q at position i, k at position j
    qs, ks = pad.at[:, i].set(q[:, 0]), pad.at[:, j].set(k[:, 0])
    return (rope(qs)[:, i] * rope(ks)[:, j]).sum()

  for shift in (1, 4, 7):
    np.testing.assert_allclose(score(3 + shift, 1 + shift), score(3, 1), rtol=1e-5)
  assert not np.isclose(score(3, 1), score(3, 2))
  # Position 0 is not rotated: rope is the identity there.
  np.testing.assert_allclose(rope(pad.at[:, 0].set(q[:, 0]))[:, 0], q[:, 0])


def test_random_positions_are_sorted_distinct_keyed_draws_in_range():
  model = build_model(model_cfg(pos_encoding="rope", random_positions=16), V, T, 0)
  tokens_BT = jnp.zeros((64, T), jnp.int32)
  pos_BT = np.asarray(model.positions(tokens_BT, jax.random.key(3)))
  assert pos_BT.shape == (64, T) and (np.diff(pos_BT, axis=1) > 0).all()
  assert pos_BT.min() >= 0 and pos_BT.max() < 16 and pos_BT.max() > T
  assert len({tuple(r) for r in pos_BT}) > 50  # a draw per row
  again = model.positions(tokens_BT, jax.random.key(3))
  np.testing.assert_array_equal(again, pos_BT)
  assert not np.array_equal(model.positions(tokens_BT, jax.random.key(4)), pos_BT)
  with pytest.raises(ValueError, match="random_positions draws positions: pass a key"):
    model(tokens_BT[:1], jnp.zeros((1,), jnp.int32))


def test_random_positions_reach_every_attention_layer():
  """The drawn positions rotate queries and keys in the prelude, every core
  iteration and the coda: the forward equals the layers applied by hand at
  those positions, and differs from positions 0..T-1. With P = T the only
  draw is 0..T-1: the plain model's output exactly."""
  cfg = dict(
    pos_encoding="rope", injection="add", num_prelude=1, num_coda=1, init_std=0.5
  )  # weights large enough that attention depends on the positions
  model = build_model(model_cfg(random_positions=11, **cfg), V, T, 0)
  tokens_BT, answer_B = inputs()
  key = jax.random.key(5)
  pos_BT = model.positions(tokens_BT, key)
  x_BTD = model.prelude[0](model.embed_tokens(tokens_BT), pos_BT=pos_BT)
  h_BTD = model.initial_state(x_BTD, key)
  for _ in range(3):
    h_BTD = model.core[0](h_BTD + x_BTD, pos_BT=pos_BT)
  h_BD = model.coda[0](h_BTD, pos_BT=pos_BT)[jnp.arange(B), answer_B]
  logits_BV = model(tokens_BT, answer_B, key=key)
  np.testing.assert_allclose(logits_BV, model.logits(h_BD), rtol=1e-5, atol=1e-5)
  trace = model.trace(tokens_BT, 3, key)
  np.testing.assert_allclose(
    trace["coda"]["hidden"][0],
    model.coda[0](h_BTD, pos_BT=pos_BT),
    rtol=1e-5,
    atol=1e-5,
  )
  plain = build_model(model_cfg(**cfg), V, T, 0)
  assert not np.allclose(plain(tokens_BT, answer_B, key=key), logits_BV, atol=1e-3)
  whole = build_model(model_cfg(random_positions=T, **cfg), V, T, 0)
  np.testing.assert_allclose(
    whole(tokens_BT, answer_B, key=key), plain(tokens_BT, answer_B), atol=1e-6
  )


def test_elementwise_attention_equals_einsum_attention():
  from loopjax.model.layers import attend, attention_probs

  q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 6, 4, 8))
  out = [attend(attention_probs(q, k, elementwise=e), v, elementwise=e) for e in (1, 0)]
  np.testing.assert_allclose(*out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  "num_loops,scan_unroll,k",
  [(4, 4, 4), (64, 4, 4), (6, 4, 3), (7, 4, 1), (2, 8, 2), (5, 1, 1)],
)
def test_group_size_divides_num_loops(num_loops, scan_unroll, k):
  from loopjax.recurrence import group_size

  assert group_size(num_loops, scan_unroll) == k


@pytest.mark.parametrize("init_state", ["random", "trunc_normal"])
def test_a_random_first_state_without_a_key_is_a_clear_error(init_state):
  model = build_model(model_cfg(init_state=init_state), V, T, 0)
  tokens, pos = jnp.zeros((1, T), jnp.int32), jnp.zeros((1,), jnp.int32)
  with pytest.raises(ValueError, match=f"model.init_state='{init_state}' draws"):
    model(tokens, pos)
  assert model(tokens, pos, key=jax.random.key(0)).shape == (1, V)
