"""The looped-LM layer options, each against a small numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import lm as lm_experiment
from loopjax.model import blocked_attention, layers
from loopjax.state import build_model


def cfg(**overrides):
  c = lm_experiment.get_config("tiny").model
  c.update(d_model=16, num_heads=4, **overrides)
  return c


def x_BTD(T=6, D=16, seed=0):
  return np.random.default_rng(seed).normal(size=(2, T, D)).astype(np.float32)


def test_rmsnorm_eps():
  norm = layers.Norm(16, "rmsnorm", rngs=nnx.Rngs(0), eps=0.5)
  x = x_BTD()
  ref = x / np.sqrt((x**2).mean(-1, keepdims=True) + 0.5)
  np.testing.assert_allclose(norm(jnp.asarray(x)), ref, rtol=1e-5)


def test_swiglu_mlp_has_no_biases_and_gates():
  mlp = layers.Mlp(cfg(mlp_type="swiglu", mlp_hidden=24), rngs=nnx.Rngs(0))
  w_in, w_out = np.asarray(mlp.w_in), np.asarray(mlp.w_out)
  assert w_in.shape == (16, 2, 24) and not hasattr(mlp, "b1")
  x = x_BTD()
  g, u = x @ w_in[:, 0], x @ w_in[:, 1]
  ref = (g / (1 + np.exp(-g)) * u) @ w_out
  np.testing.assert_allclose(mlp(jnp.asarray(x)), ref, rtol=1e-4, atol=1e-5)


def _rotate(x, theta, pairs):
  """numpy RoPE: rotate each (i, j) pair of the last axis by pos * theta^(-2k/H)."""
  T, H = x.shape[1], x.shape[-1]
  out = x.copy()
  for k, (i, j) in enumerate(pairs):
    angle = np.arange(T)[None, :, None] * theta ** (-2 * k / H)
    out[..., i] = x[..., i] * np.cos(angle) - x[..., j] * np.sin(angle)
    out[..., j] = x[..., i] * np.sin(angle) + x[..., j] * np.cos(angle)
  return out


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_rope_pairing_and_theta(pairing):
  x = np.random.default_rng(1).normal(size=(2, 5, 3, 8)).astype(np.float32)
  pairs = (
    [(i, i + 4) for i in range(4)]
    if pairing == "half"
    else [(2 * i, 2 * i + 1) for i in range(4)]
  )
  got = layers.rope(jnp.asarray(x), base=500.0, pairing=pairing)
  np.testing.assert_allclose(got, _rotate(x, 500.0, pairs), rtol=1e-5, atol=1e-5)


def _attention_ref(attn, x, N, K):
  """numpy causal attention with each key/value head shared by N/K query heads."""
  wq, wkv = np.asarray(attn.wq), np.asarray(attn.wkv)
  B, T, D = x.shape
  H = D // N
  q = np.einsum("btd,dnh->btnh", x, wq)
  k, v = (np.einsum("btd,dkh->btkh", x, wkv[:, i]) for i in range(2))
  if attn.rotary:
    half = [(i, i + H // 2) for i in range(H // 2)]
    q, k = _rotate(q, 10_000.0, half), _rotate(k, 10_000.0, half)
  k, v = np.repeat(k, N // K, 2), np.repeat(v, N // K, 2)
  logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
  logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.einsum("bnts,bsnh->btnh", p, v).reshape(B, T, D)
  return out @ np.asarray(attn.wo).reshape(D, D) + np.asarray(attn.bo)


@pytest.mark.parametrize("T", [4, 20])  # the elementwise path and the fused one
def test_grouped_query_attention(T):
  attn = layers.Attention(cfg(num_kv_heads=2), rngs=nnx.Rngs(0))
  assert attn.wkv.shape == (16, 2, 2, 4) and not hasattr(attn, "wqkv")
  x = x_BTD(T)
  np.testing.assert_allclose(
    attn(jnp.asarray(x)), _attention_ref(attn, x, 4, 2), rtol=1e-4, atol=1e-5
  )


@pytest.mark.parametrize("max_blocks", [16, 2])
def test_blocked_attention_and_its_gradient_equal_the_explicit_softmax(
  monkeypatch, max_blocks
):
  """Grouped heads (4 query, 2 key), two documents, 150 positions: three
  query blocks, one partial (or, at most 2 blocks, a longer one of 128 and
  the rest); its own backward against autodiff of the weights written out."""
  monkeypatch.setattr(blocked_attention, "MAX_BLOCKS", max_blocks)
  B, T, N, K, H = 2, 150, 4, 2, 8
  rng = np.random.default_rng(3)
  q, k, v, w = (
    jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.float32) for n in (N, K, K, N)
  )
  seg = np.repeat([[0] * 70 + [1] * (T - 70)], B, 0)
  same = jnp.asarray(seg[:, :, None] == seg[:, None])

  def explicit(q, k, v):
    k, v = (jnp.repeat(a, N // K, axis=2) for a in (k, v))
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    seen = jnp.tril(jnp.ones((T, T), bool))[None, None] & same[:, None]
    p = jax.nn.softmax(jnp.where(seen, logits, -1e30), -1)
    return jnp.einsum("bnts,bsnh->btnh", p, v)

  def blocked(q, k, v):
    return blocked_attention.causal_attention(q, k, v, jnp.asarray(seg))

  assert len(blocked_attention.blocks(T)) == min(3, max_blocks)
  assert T % blocked_attention.block_len(T)
  # Jitted: one compile each, where op by op dispatch took ~15 s on a CPU.
  explicit, blocked = jax.jit(explicit), jax.jit(blocked)
  np.testing.assert_allclose(blocked(q, k, v), explicit(q, k, v), atol=1e-5)
  ga, gb = (
    jax.jit(jax.grad(lambda *a, f=f: (f(*a) * w).sum(), (0, 1, 2)))(q, k, v)
    for f in (explicit, blocked)
  )
  for a, b in zip(ga, gb, strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


# ~5 s; the Huginn parity fixture covers the placement.
@pytest.mark.slow
def test_residual_norm_placement_normalizes_the_stream_after_each_add():
  block = layers.Block(
    cfg(norm_position="residual", norm_type="rmsnorm"), rngs=nnx.Rngs(0)
  )
  x = jnp.asarray(x_BTD(8))
  x1 = block.norm1_out(x + block.attn(block.norm1(x)))
  ref = block.norm2_out(x1 + block.mlp(block.norm2(x1)))
  np.testing.assert_allclose(block(x), ref, rtol=1e-5, atol=1e-6)
  rms = np.sqrt((np.asarray(block(x)) ** 2).mean(-1))
  np.testing.assert_allclose(rms, 1.0, rtol=1e-3)  # scales start at one


def test_embed_scale_and_state_norm():
  plain = build_model(cfg(), 50, 8, 0)
  scaled = build_model(
    cfg(embed_scale=4.0, state_norm=True, norm_type="rmsnorm"), 50, 8, 0
  )
  t = jnp.asarray([[3, 1, 4, 1, 5]])
  np.testing.assert_allclose(
    scaled.embed_tokens(t), 4.0 * plain.embed_tokens(t), rtol=1e-6
  )
  x, h = scaled.encode(t)
  out = np.asarray(scaled.core_step(h, x))
  np.testing.assert_allclose(np.sqrt((out**2).mean(-1)), 1.0, rtol=1e-3)


# ~8 s; test_lm_model's cache test keeps decoding in-suite.
@pytest.mark.slow
def test_a_huginn_shaped_block_decodes_like_its_forward():
  from loopjax.lm.generate import generate
  from loopjax.state import Model

  m = build_model(
    cfg(
      num_kv_heads=2,
      mlp_type="swiglu",
      rope_pairing="interleaved",
      norm_position="residual",
      norm_type="rmsnorm",
      embed_scale=4.0,
      injection="concat",
      init_state="zeros",
      num_prelude=1,
      num_coda=1,
      state_norm=True,
    ),
    50,
    24,
    0,
  )
  params = nnx.to_pure_dict(nnx.state(m, nnx.Param))
  prompt = np.asarray([[1, 7, 9, 3]], np.int32)
  g = generate(Model(nnx.graphdef(m), params), prompt, 6, num_loops=2, keep_logits=True)
  full = np.asarray(m(jnp.concatenate([prompt, np.asarray(g.tokens)], 1), None))
  np.testing.assert_allclose(g.logits, full[:, 3:9], atol=2e-4)
