"""Transformer layers with logical axis names on every parameter.

Axis names (`vocab`, `embed`, `heads`, `kv`, `mlp`) are mapped to mesh axes by
`sharding.py`; here they are only metadata (no eager sharding).
"""

import jax
import jax.numpy as jnp
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

  def __call__(self, x_BTD):
    """Normalizes the last axis of a (B, T, D) array."""
    x = x_BTD.astype(jnp.float32)
    if self.bias is not None:
      x = x - x.mean(-1, keepdims=True)
    y = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + _NORM_EPS)
    y = y * self.scale[None, None]
    if self.bias is not None:
      y = y + self.bias[None, None]
    return y.astype(x_BTD.dtype)


class Attention(nnx.Module):
  """Causal multi-head self-attention."""

  def __init__(self, d: int, num_heads: int, init_std: float, *, rngs: nnx.Rngs):
    hd = d // num_heads
    normal = nnx.initializers.normal(init_std)
    self.wqkv = param(
      rngs, normal, (d, 3, num_heads, hd), ("embed", None, "heads", "kv")
    )
    self.bqkv = zeros(rngs, (3, num_heads, hd), (None, "heads", "kv"))
    self.wo = param(rngs, normal, (num_heads, hd, d), ("heads", "kv", "embed"))
    self.bo = zeros(rngs, (d,), ("embed",))

  def __call__(self, x_BTD):
    qkv_3BTNH = (
      jnp.einsum("btd,dsnh->sbtnh", x_BTD, self.wqkv) + self.bqkv[:, None, None]
    )
    q_BTNH, k_BSNH, v_BSNH = qkv_3BTNH
    scale = q_BTNH.shape[-1] ** -0.5
    logits_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BSNH).astype(jnp.float32)
    T = x_BTD.shape[1]
    causal_TS = jnp.tril(jnp.ones((T, T), bool))
    logits_BNTS = jnp.where(causal_TS[None, None], logits_BNTS * scale, -1e30)
    probs_BNTS = jax.nn.softmax(logits_BNTS, axis=-1).astype(x_BTD.dtype)
    out_BTNH = jnp.einsum("bnts,bsnh->btnh", probs_BNTS, v_BSNH)
    return jnp.einsum("btnh,nhd->btd", out_BTNH, self.wo) + self.bo[None, None]


class Mlp(nnx.Module):
  def __init__(self, d: int, hidden: int, init_std: float, *, rngs: nnx.Rngs):
    normal = nnx.initializers.normal(init_std)
    self.w1 = param(rngs, normal, (d, hidden), ("embed", "mlp"))
    self.b1 = zeros(rngs, (hidden,), ("mlp",))
    self.w2 = param(rngs, normal, (hidden, d), ("mlp", "embed"))
    self.b2 = zeros(rngs, (d,), ("embed",))

  def __call__(self, x_BTD):
    h_BTF = jax.nn.gelu(x_BTD @ self.w1 + self.b1[None, None])
    return h_BTF @ self.w2 + self.b2[None, None]


class Block(nnx.Module):
  """One transformer layer; `position` places the norms (pre / sandwich / post)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, kind = cfg.d_model, cfg.norm_type
    self.position = cfg.norm_position
    self.attn = Attention(d, cfg.num_heads, cfg.init_std, rngs=rngs)
    self.mlp = Mlp(d, cfg.mlp_ratio * d, cfg.init_std, rngs=rngs)
    self.norm1 = Norm(d, kind, rngs=rngs)
    self.norm2 = Norm(d, kind, rngs=rngs)
    if self.position == "sandwich":
      self.norm1_out = Norm(d, kind, rngs=rngs)
      self.norm2_out = Norm(d, kind, rngs=rngs)

  def __call__(self, x_BTD):
    if self.position == "post":
      x_BTD = self.norm1(x_BTD + self.attn(x_BTD))
      return self.norm2(x_BTD + self.mlp(x_BTD))
    a_BTD = self.attn(self.norm1(x_BTD))
    if self.position == "sandwich":
      a_BTD = self.norm1_out(a_BTD)
    x_BTD = x_BTD + a_BTD
    m_BTD = self.mlp(self.norm2(x_BTD))
    if self.position == "sandwich":
      m_BTD = self.norm2_out(m_BTD)
    return x_BTD + m_BTD
