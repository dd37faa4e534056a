"""Transformer layers with logical axis names on every parameter.

Projections are 2-D matmuls over M = B*T rows: for these, XLA:CPU computes the
weight gradients without transposed copies of the activations, which made the
backward pass of 3-D einsums ~35% copies (docs/performance.md).

Axis names (`vocab`, `embed`, `heads`, `kv`, `mlp`) are mapped to mesh axes by
`sharding.py`; here they are only metadata (no eager sharding).
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_NORM_EPS = 1e-5


def param(rngs: nnx.Rngs, init, shape, axes) -> nnx.Param:
  """A float32 parameter tagged with logical axis names."""
  return nnx.Param(
    init(rngs.params(), shape, jnp.float32), out_sharding=axes, eager_sharding=False
  )


def zeros(rngs, shape, axes):
  return param(rngs, nnx.initializers.zeros, shape, axes)


class Norm(nnx.Module):
  """LayerNorm or RMSNorm, computed in float32 whatever the activation dtype."""

  def __init__(self, d: int, kind: str, *, rngs: nnx.Rngs):
    self.scale = param(rngs, nnx.initializers.ones, (d,), ("embed",))
    self.bias = zeros(rngs, (d,), ("embed",)) if kind == "layernorm" else None

  def __call__(self, x_D):
    """Normalizes the last axis (any leading axes: the logit lens reads stacks)."""
    x = x_D.astype(jnp.float32)
    if self.bias is not None:
      x = x - x.mean(-1, keepdims=True)
    y = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + _NORM_EPS)
    lead = (1,) * (x.ndim - 1)
    y = y * self.scale.reshape(*lead, -1)
    if self.bias is not None:
      y = y + self.bias.reshape(*lead, -1)
    return y.astype(x_D.dtype)


def rope(x_BTNH, base: float = 10_000.0):
  """Rotary position embedding (Su et al. 2021): rotates pairs of dimensions by
  position-dependent angles, so q.k depends on positions only through their
  difference (chains longer than any trained on keep familiar offsets)."""
  T, H = x_BTNH.shape[1], x_BTNH.shape[3]
  angle_TF = np.arange(T)[:, None] * base ** (-np.arange(0, H, 2) / H)[None]
  cos, sin = (f(angle_TF)[None, :, None].astype(x_BTNH.dtype) for f in (np.cos, np.sin))
  x1, x2 = x_BTNH[..., : H // 2], x_BTNH[..., H // 2 :]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Attention(nnx.Module):
  """Causal multi-head self-attention, optionally with rotary positions."""

  def __init__(
    self,
    d: int,
    num_heads: int,
    init_std: float,
    *,
    rngs: nnx.Rngs,
    rotary=False,
    out_scale: float = 1.0,
  ):
    """`out_scale` scales the output projection's initial weights (LTG's
    `c_scale`; 0: each block starts as the identity on the residual stream)."""
    self.rotary = rotary
    hd = d // num_heads
    normal = nnx.initializers.normal(init_std)
    self.wqkv = param(
      rngs, normal, (d, 3, num_heads, hd), ("embed", None, "heads", "kv")
    )
    self.bqkv = zeros(rngs, (3, num_heads, hd), (None, "heads", "kv"))
    self.wo = param(
      rngs, _scaled(normal, out_scale), (num_heads, hd, d), ("heads", "kv", "embed")
    )
    self.bo = zeros(rngs, (d,), ("embed",))

  def __call__(self, x_BTD, with_probs: bool = False):
    """(B, T, D) -> (B, T, D); with_probs: also the weights, (B, N, T, S)."""
    B, T, D = x_BTD.shape
    _, _, N, H = self.wqkv.shape
    qkv_MK = x_BTD.reshape(B * T, D) @ self.wqkv.reshape(D, 3 * N * H)
    qkv_BT3NH = qkv_MK.reshape(B, T, 3, N, H) + self.bqkv[None, None]
    q_BTNH, k_BSNH, v_BSNH = (qkv_BT3NH[:, :, i] for i in range(3))
    if self.rotary:
      q_BTNH, k_BSNH = rope(q_BTNH), rope(k_BSNH)
    elementwise = T <= ELEMENTWISE_MAX_LEN
    probs_BTSN = attention_probs(q_BTNH, k_BSNH, elementwise=elementwise)
    out_BTNH = attend(probs_BTSN, v_BSNH, elementwise=elementwise)
    out_MD = out_BTNH.reshape(B * T, N * H) @ self.wo.reshape(N * H, D)
    out_BTD = (out_MD + self.bo[None]).reshape(B, T, D)
    return (out_BTD, probs_BTSN.transpose(0, 3, 1, 2)) if with_probs else out_BTD


# Up to this length, attention's two products run as broadcast-multiply-sums:
# on CPU that trains the 3-token composition task ~15% faster than batches of
# T x T matmul tiles (docs/performance.md); longer sequences use einsums.
ELEMENTWISE_MAX_LEN = 8


def attention_probs(q_BTNH, k_BSNH, *, elementwise: bool):
  """Causal softmax weights (B, T, S, N): query t's distribution over keys s."""
  if elementwise:
    logits_BTSN = (q_BTNH[:, :, None] * k_BSNH[:, None]).sum(-1)
  else:
    logits_BTSN = jnp.einsum("btnh,bsnh->btsn", q_BTNH, k_BSNH)
  T, H = q_BTNH.shape[1], q_BTNH.shape[-1]
  causal_TS = jnp.tril(jnp.ones((T, T), bool))[None, :, :, None]
  logits_BTSN = jnp.where(causal_TS, logits_BTSN.astype(jnp.float32) * H**-0.5, -1e30)
  return jax.nn.softmax(logits_BTSN, axis=2).astype(q_BTNH.dtype)


def attend(probs_BTSN, v_BSNH, *, elementwise: bool):
  """The attention output (B, T, N, H): values averaged by the weights."""
  if elementwise:
    return (probs_BTSN[..., None] * v_BSNH[:, None]).sum(2)
  return jnp.einsum("btsn,bsnh->btnh", probs_BTSN, v_BSNH)


def _scaled(init, scale: float):
  return lambda key, shape, dtype: scale * init(key, shape, dtype)


class Mlp(nnx.Module):
  def __init__(
    self, d: int, hidden: int, init_std: float, *, rngs: nnx.Rngs, out_scale=1.0
  ):
    normal = nnx.initializers.normal(init_std)
    self.w1 = param(rngs, normal, (d, hidden), ("embed", "mlp"))
    self.b1 = zeros(rngs, (hidden,), ("mlp",))
    self.w2 = param(rngs, _scaled(normal, out_scale), (hidden, d), ("mlp", "embed"))
    self.b2 = zeros(rngs, (d,), ("embed",))

  def __call__(self, x_BTD):
    B, T, D = x_BTD.shape
    h_MF = jax.nn.gelu(x_BTD.reshape(B * T, D) @ self.w1 + self.b1[None])
    return (h_MF @ self.w2 + self.b2[None]).reshape(B, T, D)


class Block(nnx.Module):
  """One transformer layer; `position` places the norms (pre / sandwich / post)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, kind = cfg.d_model, cfg.norm_type
    self.position = cfg.norm_position
    self.attn = Attention(
      d,
      cfg.num_heads,
      cfg.init_std,
      rngs=rngs,
      rotary=cfg.pos_encoding == "rope",
      out_scale=cfg.out_init_scale,
    )
    self.mlp = Mlp(
      d, cfg.mlp_ratio * d, cfg.init_std, rngs=rngs, out_scale=cfg.out_init_scale
    )
    self.norm1 = Norm(d, kind, rngs=rngs)
    self.norm2 = Norm(d, kind, rngs=rngs)
    if self.position == "sandwich":
      self.norm1_out = Norm(d, kind, rngs=rngs)
      self.norm2_out = Norm(d, kind, rngs=rngs)

  def __call__(self, x_BTD, with_probs: bool = False):
    """(B, T, D) -> (B, T, D); with_probs: also the attention weights."""
    if self.position == "post":
      a_BTD, probs = self.attn(x_BTD, with_probs=True)
      x_BTD = self.norm1(x_BTD + a_BTD)
      x_BTD = self.norm2(x_BTD + self.mlp(x_BTD))
      return (x_BTD, probs) if with_probs else x_BTD
    a_BTD, probs = self.attn(self.norm1(x_BTD), with_probs=True)
    if self.position == "sandwich":
      a_BTD = self.norm1_out(a_BTD)
    x_BTD = x_BTD + a_BTD
    m_BTD = self.mlp(self.norm2(x_BTD))
    if self.position == "sandwich":
      m_BTD = self.norm2_out(m_BTD)
    x_BTD = x_BTD + m_BTD
    return (x_BTD, probs) if with_probs else x_BTD
