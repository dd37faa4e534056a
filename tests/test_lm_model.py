"""The LM readout: causality, documents kept apart, the masked loss, the cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import lm as lm_experiment
from loopjax import loss
from loopjax.lm.generate import generate
from loopjax.state import Model, build_model

V, T = 64, 40  # T > layers.ELEMENTWISE_MAX_LEN: the fused-attention path


def model(**overrides):
  c = lm_experiment.get_config("tiny").model
  c.update(d_model=32, num_heads=4, num_loops=3, **overrides)
  return build_model(c, V, T, seed=0)


def tokens(seed=0, shape=(2, T)):
  return jnp.asarray(np.random.default_rng(seed).integers(0, V, shape), jnp.int32)


@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_logits_at_t_do_not_depend_on_later_tokens(pos):
  m, x = model(pos_encoding=pos, num_prelude=1, num_coda=1), tokens()
  y = x.at[:, 25:].set((x[:, 25:] + 1) % V)
  a, b = m(x, None), m(y, None)
  assert a.shape == (2, T, V)
  np.testing.assert_allclose(a[:, :25], b[:, :25], atol=1e-5)
  assert not np.allclose(a[:, 25:], b[:, 25:], atol=1e-3)


def test_a_packed_document_is_computed_as_if_alone():
  """Segments keep attention inside a document; with relative (rope)
  positions, document 2's logits equal those of document 2 run alone."""
  m, x = model(), tokens()
  segments = jnp.asarray(np.repeat([[0] * 15 + [1] * 25], 2, 0), jnp.int32)
  packed = m(x, None, segments_BT=segments)
  alone = m(x[:, 15:], None)
  np.testing.assert_allclose(packed[:, 15:], alone, atol=2e-5)
  mixed = m(x, None)  # without segments, document 2 sees document 1
  assert not np.allclose(mixed[:, 15:], alone, atol=1e-3)


@pytest.mark.parametrize("length", [T, 150])  # 150: CPU query blocks, one partial
def test_fused_attention_equals_the_explicit_weights(length):
  attn = model().core[0].attn
  x = jax.random.normal(jax.random.key(1), (2, length, 32))
  seg = jnp.asarray(np.repeat([[0] * 10 + [1] * (length - 10)], 2, 0), jnp.int32)
  # Jitted: one compile each, where op by op every op compiles.
  fused = nnx.jit(lambda a, x, s: a(x, segments_BT=s))(attn, x, seg)
  explicit, probs = nnx.jit(lambda a, x, s: a(x, with_probs=True, segments_BT=s))(
    attn, x, seg
  )
  np.testing.assert_allclose(fused, explicit, atol=1e-5)
  assert float(probs[:, :, 12, :10].max()) == 0.0  # doc 2 never attends to doc 1


def test_masked_targets_do_not_count():
  logits = jax.random.normal(jax.random.key(0), (2, 5, V))
  t = tokens(1, (2, 5))
  mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], jnp.float32)
  a = loss.lm_xent(logits, t, mask)
  b = loss.lm_xent(logits, t.at[0, 3:].set(0), mask)
  assert a[2] == 8 and np.allclose(a[0], b[0])
  # Against a numpy reference: -log softmax at the target, summed over the mask.
  lp = np.asarray(jax.nn.log_softmax(logits))
  ref = -sum(lp[i, j, t[i, j]] for i in range(2) for j in range(5) if mask[i, j])
  np.testing.assert_allclose(a[0], ref, rtol=1e-5)
  z = loss.lm_xent(logits, t, mask, z_loss=0.1)[0] - a[0]
  lse = np.asarray(jax.nn.logsumexp(logits, -1))
  np.testing.assert_allclose(z, 0.1 * (lse**2 * np.asarray(mask)).sum(), rtol=1e-5)


@pytest.mark.parametrize(
  "overrides",
  [
    dict(),
    dict(pos_encoding="learned", num_prelude=1, num_coda=1, injection="concat"),
    dict(norm_position="sandwich", injection="none"),
  ],
)
def test_decoding_with_the_cache_equals_the_full_forward(overrides):
  m = model(**overrides)
  params = nnx.to_pure_dict(nnx.state(m, nnx.Param))
  graphdef = nnx.graphdef(m)
  prompt = np.asarray(tokens(3, (2, 7)))
  g = generate(Model(graphdef, params), prompt, 12, num_loops=3, keep_logits=True)
  out, step_logits = np.concatenate([prompt, np.asarray(g.tokens)], 1), g.logits
  assert out.shape == (2, 19)
  full = np.asarray(m(jnp.asarray(out), None))  # logits at every position
  # The logits that chose token t+1 are the full forward's at position t.
  np.testing.assert_allclose(step_logits, full[:, 6:18], atol=2e-4)
  np.testing.assert_array_equal(out[:, 7:], full[:, 6:18].argmax(-1))


def test_more_recurrences_at_sampling_are_more_iterations():
  m = model()
  params = nnx.to_pure_dict(nnx.state(m, nnx.Param))
  prompt = np.asarray(tokens(4, (1, 5)))
  at3, at6 = (
    generate(
      Model(nnx.graphdef(m), params), prompt, 2, num_loops=r, keep_logits=True
    ).logits
    for r in (3, 6)
  )
  np.testing.assert_allclose(
    at6[:, 0], m(jnp.asarray(prompt), None, num_loops=6)[:, -1], atol=2e-4
  )
  assert not np.allclose(at3, at6, atol=1e-3)


# Ouro's shape (state_norm, no coda): the readout reads the normed state as is.
@pytest.mark.parametrize("shape", [dict(num_coda=1), dict(num_coda=0, state_norm=True)])
def test_the_chunked_loss_equals_the_loss_of_the_whole_logits(shape):
  import ml_collections

  m, x = model(**shape), tokens(5, (2, 128))  # 128 = 2 chunks of LM_LOSS_CHUNK
  # A final norm whose scale is not 1, so normalizing twice would show.
  m.norm.scale[...] = jnp.linspace(0.5, 2.0, m.norm.scale.shape[0])
  assert 128 // loss.LM_LOSS_CHUNK == 2
  t = tokens(6, (2, 128))
  mask = jnp.asarray(np.random.default_rng(7).random((2, 128)) < 0.8, jnp.float32)
  batch = dict(inputs=x, targets=t, mask=mask, segments=jnp.zeros((2, 128), jnp.int32))
  cfg = ml_collections.ConfigDict(dict(backprop_depth=0, z_loss=1e-3))
  got = loss.lm_loss_fn(m, batch, cfg, key=None, num_loops=3)
  total, correct, n = loss.lm_xent(m(x, None), t, mask, 1e-3)
  np.testing.assert_allclose(got, (total / n, correct / n), rtol=1e-5)


def test_the_fused_loss_gradient_equals_autodiff_of_the_whole_logits():
  k = jax.random.split(jax.random.key(0), 3)
  x, w = jax.random.normal(k[0], (2, 128, 16)), jax.random.normal(k[1], (16, 50))
  t = jax.random.randint(k[2], (2, 128), 0, 50)
  mask = jnp.asarray(np.random.default_rng(8).random((2, 128)) < 0.7, jnp.float32)

  def fused(x, w):
    total, correct, n = loss.lm_sums(x, w, t, mask, 1e-2)
    return 3 * total / n, correct

  def whole(x, w):
    total, correct, n = loss.lm_xent(x @ w, t, mask, 1e-2)
    return 3 * total / n, correct

  (a, ca), ga = jax.value_and_grad(fused, (0, 1), has_aux=True)(x, w)
  (b, cb), gb = jax.value_and_grad(whole, (0, 1), has_aux=True)(x, w)
  np.testing.assert_allclose(a, b, rtol=1e-5)
  assert ca == cb and ca > 0
  for u, v in zip(ga, gb, strict=True):
    np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-6)
  assert float(jnp.abs(ga[0][mask == 0]).max()) == 0.0  # padding gets none


def test_sampling_from_a_random_initial_state_draws_one_per_call():
  m = model(init_state="random", injection="add")
  params = nnx.to_pure_dict(nnx.state(m, nnx.Param))
  g = generate(
    Model(nnx.graphdef(m), params),
    np.asarray(tokens(8, (1, 4))),
    3,
    num_loops=2,
    keep_logits=True,
  )
  assert len(g.tokens[0]) == 3 and np.isfinite(g.logits).all()
