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

from loopjax.model import attention_kernels


def param(rngs: nnx.Rngs, init, shape, axes) -> nnx.Param:
  """A float32 parameter tagged with logical axis names."""
  return nnx.Param(
    init(rngs.params(), shape, jnp.float32), out_sharding=axes, eager_sharding=False
  )


def zeros(rngs, shape, axes):
  return param(rngs, nnx.initializers.zeros, shape, axes)


class Norm(nnx.Module):
  """LayerNorm or RMSNorm, computed in float32 whatever the activation dtype."""

  def __init__(self, d: int, kind: str, *, rngs: nnx.Rngs, eps: float = 1e-5):
    self.eps = eps
    self.scale = param(rngs, nnx.initializers.ones, (d,), ("embed",))
    self.bias = zeros(rngs, (d,), ("embed",)) if kind == "layernorm" else None

  def __call__(self, x_D):
    """Normalizes the last axis (any leading axes: the logit lens reads stacks)."""
    x = x_D.astype(jnp.float32)
    if self.bias is not None:
      x = x - x.mean(-1, keepdims=True)
    y = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + self.eps)
    lead = (1,) * (x.ndim - 1)
    y = y * self.scale.reshape(*lead, -1)
    if self.bias is not None:
      y = y + self.bias.reshape(*lead, -1)
    return y.astype(x_D.dtype)


def rope_frequencies(H: int, base: float, llama3=()) -> np.ndarray:
  """The H/2 rotation frequencies; `llama3` (factor, low_freq_factor,
  high_freq_factor, original context): Llama 3.1's rescaling, which slows the
  frequencies whose wavelength exceeds the original context / low_freq_factor
  by `factor`, keeps those under context / high_freq_factor, and blends the
  two in between (what a checkpoint trained with it expects)."""
  freq_F = base ** (-np.arange(0, H, 2) / H)
  if not llama3:
    return freq_F
  factor, low, high, context = llama3
  wavelen_F = 2 * np.pi / freq_F
  smooth_F = (context / wavelen_F - low) / (high - low)
  blend_F = (1 - smooth_F) * freq_F / factor + smooth_F * freq_F
  return np.where(
    wavelen_F > context / low,
    freq_F / factor,
    np.where(wavelen_F < context / high, freq_F, blend_F),
  )


def rope(
  x_BTNH,
  base: float = 10_000.0,
  offset=0,
  pairing: str = "half",
  llama3=(),
  start_B=None,
  pos_BT=None,
):
  """Rotary position embedding (Su et al. 2021): rotates pairs of dimensions by
  position-dependent angles, so q.k depends on positions only through their
  difference (chains longer than any trained on keep familiar offsets).
  `offset`: the position of the first token (decoding with a cache; traced);
  `start_B`: each row's first real slot (left-padded prompts), from which its
  positions count; `pos_BT`: each row's positions given whole (B, T)
  (`model.random_positions`).
  `pairing`: which dimensions rotate together, (i, i + H/2) ("half": Llama,
  GPT-NeoX) or (2i, 2i + 1) ("interleaved": the original, Huginn); `llama3`:
  see `rope_frequencies`."""
  T, H = x_BTNH.shape[1], x_BTNH.shape[3]
  freq_F = rope_frequencies(H, base, llama3)
  if isinstance(offset, int) and start_B is None and pos_BT is None:  # folded
    angle_TF = (offset + np.arange(T))[:, None] * freq_F[None]
    cos, sin = (f[None, :, None] for f in (np.cos(angle_TF), np.sin(angle_TF)))
  else:
    if pos_BT is None:
      pos_BT = positions(offset, T, start_B)
    angle_BTF = pos_BT[..., None] * freq_F[None, None]
    cos, sin = (f[:, :, None] for f in (jnp.cos(angle_BTF), jnp.sin(angle_BTF)))
  cos, sin = (f.astype(x_BTNH.dtype) for f in (cos, sin))
  if pairing == "interleaved":
    x1, x2 = x_BTNH[..., 0::2], x_BTNH[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).reshape(
      x_BTNH.shape
    )
  x1, x2 = x_BTNH[..., : H // 2], x_BTNH[..., H // 2 :]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def positions(offset, T: int, start_B=None):
  """Positions (B or 1, T) of T tokens in slots offset..: counted from each
  row's `start_B` (left-padded prompts; earlier slots clip to 0)."""
  pos_1T = (offset + jnp.arange(T))[None]
  return pos_1T if start_B is None else jnp.maximum(pos_1T - start_B[:, None], 0)


class Attention(nnx.Module):
  """Causal multi-head self-attention, optionally with rotary positions and
  grouped-query heads (`num_kv_heads` < `num_heads`: each key/value head
  serves num_heads / num_kv_heads query heads; grouped projections have no
  biases, as in Llama; the fused one keeps GPT-2's)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    """`cfg.out_init_scale` scales the output projection's initial weights
    (LTG's `c_scale`; 0: each block starts as the identity on the residual)."""
    d, N = cfg.d_model, cfg.num_heads
    K, hd = cfg.num_kv_heads or N, d // N
    self.rotary = cfg.pos_encoding == "rope"
    self.kernel, self.document_mask = cfg.attention, cfg.document_mask
    self.rope = dict(
      base=cfg.rope_theta, pairing=cfg.rope_pairing, llama3=tuple(cfg.rope_llama3)
    )
    # OLMo 2: all heads' queries (and keys) normalized together, before RoPE.
    if cfg.qk_norm:
      self.q_norm = Norm(N * hd, cfg.norm_type, rngs=rngs, eps=cfg.norm_eps)
      self.k_norm = Norm(K * hd, cfg.norm_type, rngs=rngs, eps=cfg.norm_eps)
    normal = nnx.initializers.normal(cfg.init_std)
    if K == N:  # one fused projection
      self.wqkv = param(rngs, normal, (d, 3, N, hd), ("embed", None, "heads", "kv"))
      self.bqkv = zeros(rngs, (3, N, hd), (None, "heads", "kv"))
    else:
      self.wq = param(rngs, normal, (d, N, hd), ("embed", "heads", "kv"))
      self.wkv = param(rngs, normal, (d, 2, K, hd), ("embed", None, "heads", "kv"))
    self.wo = param(
      rngs,
      _scaled(normal, cfg.out_init_scale),
      (N, hd, d),
      ("heads", "kv", "embed"),
    )
    self.bo = zeros(rngs, (d,), ("embed",))

  def _qkv(self, x_BTD, offset=0, start_B=None, pos_BT=None):
    """q (B, T, N, H) and k, v (B, T, K, H), rotated where rotary."""
    B, T, D = x_BTD.shape
    x_MD = x_BTD.reshape(B * T, D)
    if hasattr(self, "wqkv"):
      _, _, N, H = self.wqkv.shape
      qkv_MK = x_MD @ self.wqkv.reshape(D, 3 * N * H)
      qkv_BT3NH = qkv_MK.reshape(B, T, 3, N, H) + self.bqkv[None, None]
      q_BTNH, k_BTKH, v_BTKH = (qkv_BT3NH[:, :, i] for i in range(3))
    else:
      _, N, H = self.wq.shape
      K = self.wkv.shape[2]
      q_BTNH = (x_MD @ self.wq.reshape(D, N * H)).reshape(B, T, N, H)
      kv_BT2KH = (x_MD @ self.wkv.reshape(D, 2 * K * H)).reshape(B, T, 2, K, H)
      k_BTKH, v_BTKH = kv_BT2KH[:, :, 0], kv_BT2KH[:, :, 1]
    if hasattr(self, "q_norm"):
      q_BTNH = self.q_norm(q_BTNH.reshape(B, T, -1)).reshape(q_BTNH.shape)
      k_BTKH = self.k_norm(k_BTKH.reshape(B, T, -1)).reshape(k_BTKH.shape)
    if self.rotary:
      at = dict(offset=offset, start_B=start_B, pos_BT=pos_BT)
      q_BTNH = rope(q_BTNH, **at, **self.rope)
      k_BTKH = rope(k_BTKH, **at, **self.rope)
    return q_BTNH, k_BTKH, v_BTKH

  def _out(self, out_BTNH):
    B, T, N, H = out_BTNH.shape
    out_MD = out_BTNH.reshape(B * T, N * H) @ self.wo.reshape(N * H, -1)
    return (out_MD + self.bo[None]).reshape(B, T, -1)

  def cached(self, x_BTD, kv, offset, start_B=None, slot=None):
    """Attention of tokens in slots offset.. over a cache of earlier keys and
    values, (B, S, K, H) each or, with `slot`, (M, B, S, K, H) each read at
    `slot`; returns the cache with these tokens' written in (in place where
    the caller donates it: only their (T, K, H) entries are new). `start_B`:
    each row's first real slot (the slots before it: left padding, never
    attended to)."""
    q_BTNH, k_BTKH, v_BTKH = self._qkv(x_BTD, offset, start_B)
    lead = () if slot is None else (slot,)
    kv = tuple(
      jax.lax.dynamic_update_slice(
        c, new.astype(c.dtype)[(None,) * len(lead)], (*lead, 0, offset, 0, 0)
      )
      for c, new in zip(kv, (k_BTKH, v_BTKH), strict=True)
    )
    k_BSKH, v_BSKH = (
      c if slot is None else jax.lax.dynamic_index_in_dim(c, slot, 0, False) for c in kv
    )
    T, S = x_BTD.shape[1], k_BSKH.shape[1]
    seen_TS = jnp.arange(S)[None] <= (offset + jnp.arange(T))[:, None]
    seen_1TS = seen_TS[None]
    if start_B is not None:
      seen_1TS = seen_1TS & (jnp.arange(S)[None, None] >= start_B[:, None, None])
    out_BTNH = jax.nn.dot_product_attention(
      q_BTNH,
      k_BSKH.astype(q_BTNH.dtype),
      v_BSKH.astype(q_BTNH.dtype),
      mask=seen_1TS[:, None],
    )
    return self._out(out_BTNH), kv

  def __call__(self, x_BTD, with_probs: bool = False, segments_BT=None, pos_BT=None):
    """(B, T, D) -> (B, T, D); with_probs: also the weights, (B, N, T, S).
    `segments_BT`: a query attends only to keys of its own segment (packed
    documents); None: to every earlier position. `pos_BT`: rotary positions
    per row (None: 0..T-1)."""
    T = x_BTD.shape[1]
    segments_BT = segments_BT if self.document_mask else None
    q_BTNH, k_BSKH, v_BSKH = self._qkv(x_BTD, pos_BT=pos_BT)
    elementwise = T <= ELEMENTWISE_MAX_LEN
    if elementwise or with_probs:
      same_BTS = (
        None if segments_BT is None else segments_BT[:, :, None] == segments_BT[:, None]
      )
      groups = q_BTNH.shape[2] // k_BSKH.shape[2]
      k_BSNH, v_BSNH = (jnp.repeat(a, groups, axis=2) for a in (k_BSKH, v_BSKH))
      probs_BTSN = attention_probs(
        q_BTNH, k_BSNH, elementwise=elementwise, same_BTS=same_BTS
      )
      out_BTNH = attend(probs_BTSN, v_BSNH, elementwise=elementwise)
    else:
      out_BTNH = attention_kernels.causal_attention(
        q_BTNH, k_BSKH, v_BSKH, segments_BT, self.kernel
      )
    out_BTD = self._out(out_BTNH)
    return (out_BTD, probs_BTSN.transpose(0, 3, 1, 2)) if with_probs else out_BTD


# Up to this length, attention's two products run as broadcast-multiply-sums:
# on CPU that trains the 3-token composition task ~15% faster than batches of
# T x T matmul tiles (docs/performance.md); longer sequences use
# the kernel `model.attention` picks (attention_kernels.py; einsums where the
# weights are wanted).
ELEMENTWISE_MAX_LEN = 8


def attention_probs(q_BTNH, k_BSNH, *, elementwise: bool, same_BTS=None):
  """Causal softmax weights (B, T, S, N): query t's distribution over keys s
  (within its segment where `same_BTS` says which keys share it)."""
  if elementwise:
    logits_BTSN = (q_BTNH[:, :, None] * k_BSNH[:, None]).sum(-1)
  else:
    logits_BTSN = jnp.einsum("btnh,bsnh->btsn", q_BTNH, k_BSNH)
  T, H = q_BTNH.shape[1], q_BTNH.shape[-1]
  causal_TS = jnp.tril(jnp.ones((T, T), bool))[None, :, :, None]
  if same_BTS is not None:
    causal_TS = causal_TS & same_BTS[..., None]
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
  """GELU with biases (GPT-2, LTG), or SwiGLU without (Llama, Huginn, Ouro):
  silu(x W_gate) * (x W_up), then W_down; gate and up are one matmul."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d = cfg.d_model
    hidden = cfg.mlp_hidden or cfg.mlp_ratio * d
    normal = nnx.initializers.normal(cfg.init_std)
    out = _scaled(normal, cfg.out_init_scale)
    self.swiglu = cfg.mlp_type == "swiglu"
    if self.swiglu:
      self.w_in = param(rngs, normal, (d, 2, hidden), ("embed", None, "mlp"))
      self.w_out = param(rngs, out, (hidden, d), ("mlp", "embed"))
      return
    self.w1 = param(rngs, normal, (d, hidden), ("embed", "mlp"))
    self.b1 = zeros(rngs, (hidden,), ("mlp",))
    self.w2 = param(rngs, out, (hidden, d), ("mlp", "embed"))
    self.b2 = zeros(rngs, (d,), ("embed",))

  def __call__(self, x_BTD):
    B, T, D = x_BTD.shape
    x_MD = x_BTD.reshape(B * T, D)
    if self.swiglu:
      F = self.w_out.shape[0]
      gate_M2F = (x_MD @ self.w_in.reshape(D, 2 * F)).reshape(-1, 2, F)
      h_MF = jax.nn.silu(gate_M2F[:, 0]) * gate_M2F[:, 1]
      return (h_MF @ self.w_out).reshape(B, T, D)
    h_MF = jax.nn.gelu(x_MD @ self.w1 + self.b1[None])
    return (h_MF @ self.w2 + self.b2[None]).reshape(B, T, D)


class Block(nnx.Module):
  """One transformer layer; `position` places the norms: "pre" (GPT-2,
  Llama), "sandwich" (each sublayer's output normalized too: Gemma-2, Ouro),
  "residual" (pre-norm, and the residual stream normalized after each add:
  Huginn), "post" (the original Transformer), "res_post" (each sublayer's
  output normalized before it joins the stream, no input norm: OLMo 2)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, kind = cfg.d_model, cfg.norm_type
    self.position = cfg.norm_position
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp = Mlp(cfg, rngs=rngs)
    norm = lambda: Norm(d, kind, rngs=rngs, eps=cfg.norm_eps)  # noqa: E731
    self.norm1, self.norm2 = norm(), norm()
    if self.position in ("sandwich", "residual"):
      self.norm1_out, self.norm2_out = norm(), norm()

  def __call__(self, x_BTD, with_probs: bool = False, segments_BT=None, pos_BT=None):
    """(B, T, D) -> (B, T, D); with_probs: also the attention weights."""
    x_BTD, probs = self._apply(
      x_BTD,
      lambda y: _split(self.attn(y, with_probs, segments_BT, pos_BT), with_probs),
    )
    return (x_BTD, probs) if with_probs else x_BTD

  def cached(self, x_BTD, kv, offset, start_B=None, slot=None):
    """The layer on tokens in slots offset.., attention over a key/value
    cache (Attention.cached): (output, the updated cache)."""
    return self._apply(x_BTD, lambda y: self.attn.cached(y, kv, offset, start_B, slot))

  def _apply(self, x_BTD, attn):
    """The layer around `attn` (input -> (output, extra)): (output, extra)."""
    if self.position == "post":
      a_BTD, extra = attn(x_BTD)
      x_BTD = self.norm1(x_BTD + a_BTD)
      return self.norm2(x_BTD + self.mlp(x_BTD)), extra
    if self.position == "res_post":
      a_BTD, extra = attn(x_BTD)
      x_BTD = x_BTD + self.norm1(a_BTD)
      return x_BTD + self.norm2(self.mlp(x_BTD)), extra
    a_BTD, extra = attn(self.norm1(x_BTD))
    if self.position == "sandwich":
      a_BTD = self.norm1_out(a_BTD)
    x_BTD = x_BTD + a_BTD
    if self.position == "residual":
      x_BTD = self.norm1_out(x_BTD)
    m_BTD = self.mlp(self.norm2(x_BTD))
    if self.position == "sandwich":
      m_BTD = self.norm2_out(m_BTD)
    x_BTD = x_BTD + m_BTD
    if self.position == "residual":
      x_BTD = self.norm2_out(x_BTD)
    return x_BTD, extra


def _split(out, with_probs: bool):
  """(output, weights or None) of an attention call."""
  return out if with_probs else (out, None)
