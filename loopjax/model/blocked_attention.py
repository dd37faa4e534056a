"""Causal attention in query blocks with a recomputing backward pass, for CPU.

Each block of BLOCK queries is scored against the keys up to its end only, so
most of the masked upper triangle is never computed, and the backward pass
recomputes each block's weights from the saved logsumexp (as FlashAttention
does) instead of differentiating through stored ones: it keeps q, k, v, the
output and one float per query, not (B, N, T, S) weights. On the `cpu` LM
shape (B 16, T 256, 4 heads of 32) one layer's forward and backward take 24
ms against 34 ms for the same blocks through `jax.nn.dot_product_attention`
(docs/performance.md). Grouped heads are computed as they are: query heads
k*G .. k*G + G - 1 share key head k (`jnp.repeat`'s order).

The blocks are unrolled: XLA compiles each one's ops apart, so compile time
grows with their number (the `lm.py:tiny` train step on a 2-core AMD EPYC: 8 s
at 1 block, 18 s at 16, 77 s at 64; at 128 its algebraic simplifier ran past
200 s). So there are at most MAX_BLOCKS of them: past BLOCK * MAX_BLOCKS
tokens the blocks grow instead, and a block's scores (B, N, T / MAX_BLOCKS,
T) are what a long sequence costs (`footprint.py` counts them). Packed
documents are kept apart per block from their segment ids: no (T, T) mask.
"""

import functools

import jax
import jax.numpy as jnp

BLOCK = 64  # queries per block, up to MAX_BLOCKS blocks
MAX_BLOCKS = 16  # then longer blocks (multiples of BLOCK): compile time bounded


def block_len(T: int) -> int:
  """Queries per block for a sequence of T: BLOCK, or more past MAX_BLOCKS."""
  return -(-max(T, 1) // (BLOCK * MAX_BLOCKS)) * BLOCK


def blocks(T: int) -> list[tuple[int, int]]:
  """The (start, end) of each query block of a sequence of T."""
  n = block_len(T)
  return [(s, min(s + n, T)) for s in range(0, T, n)]


def _logits(q_BKGTH, k_BKSH, segments_BT, s: int, e: int):
  """Scaled float32 scores of queries s:e against keys :e, (B, K, G, t, e),
  -1e30 at the keys a query may not see: later ones, other segments'. An
  added mask, not a select, so the weights exp(logits - lse) are one fusion."""
  H = q_BKGTH.shape[-1]
  scores = jnp.einsum("bkgth,bksh->bkgts", q_BKGTH[:, :, :, s:e], k_BKSH[:, :, :e])
  seen_ts = jnp.arange(e)[None] <= (s + jnp.arange(e - s))[:, None]
  seen = seen_ts[None]
  if segments_BT is not None:
    seen = seen & (segments_BT[:, s:e, None] == segments_BT[:, None, :e])
  mask = jnp.where(seen, 0.0, -1e30)[:, None, None]
  return scores.astype(jnp.float32) * H**-0.5 + mask


@jax.custom_vjp
def _attention(q_BKGTH, k_BKSH, v_BKSH, segments_BT):
  return _forward(q_BKGTH, k_BKSH, v_BKSH, segments_BT)[0]


def _forward(q_BKGTH, k_BKSH, v_BKSH, segments_BT):
  outs, lses = [], []
  for s, e in blocks(q_BKGTH.shape[3]):
    logits = _logits(q_BKGTH, k_BKSH, segments_BT, s, e)
    max_ = logits.max(-1, keepdims=True)
    p = jnp.exp(logits - max_)
    sum_ = p.sum(-1, keepdims=True)
    o = jnp.einsum("bkgts,bksh->bkgth", p.astype(v_BKSH.dtype), v_BKSH[:, :, :e])
    outs.append((o / sum_).astype(q_BKGTH.dtype))
    lses.append((max_ + jnp.log(sum_))[..., 0])
  out = jnp.concatenate(outs, 3)
  return out, (q_BKGTH, k_BKSH, v_BKSH, segments_BT, out, jnp.concatenate(lses, 3))


def _backward(res, dout_BKGTH):
  q, k, v, segments_BT, out, lse_BKGT = res
  H = q.shape[-1]
  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
  # Each query's sum over keys of p * dp: its output times the output's cotangent.
  delta_BKGT = (f32(dout_BKGTH) * f32(out)).sum(-1)
  # dk and dv are accumulated transposed, (B, K, H, S): the products then
  # contract the small (t, H) operands over t, and never transpose a (t, S) block.
  dqs = []
  dkT, dvT = (
    jnp.zeros((*a.shape[:2], a.shape[3], a.shape[2]), jnp.float32) for a in (k, v)
  )
  for s, e in blocks(q.shape[3]):
    p = jnp.exp(_logits(q, k, segments_BT, s, e) - lse_BKGT[..., s:e, None])
    do = f32(dout_BKGTH[:, :, :, s:e])
    dvT = dvT.at[..., :e].add(jnp.einsum("bkgth,bkgts->bkhs", do, p))
    dp = jnp.einsum("bkgth,bksh->bkgts", do, f32(v[:, :, :e]))
    ds = p * (dp - delta_BKGT[..., s:e, None]) * H**-0.5
    dqs.append(jnp.einsum("bkgts,bksh->bkgth", ds, f32(k[:, :, :e])))
    dkT = dkT.at[..., :e].add(jnp.einsum("bkgth,bkgts->bkhs", f32(q[:, :, :, s:e]), ds))
  dq = jnp.concatenate(dqs, 3)
  dk, dv = (jnp.swapaxes(a, 2, 3) for a in (dkT, dvT))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_forward, _backward)


def causal_attention(q_BTNH, k_BSKH, v_BSKH, segments_BT=None):
  """softmax(q k^T / sqrt(H)) v over each query's earlier keys (within its
  segment, where `segments_BT` gives each position's): (B, T, N, H), as
  `jax.nn.dot_product_attention` with is_causal."""
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  q_BKGTH = q_BTNH.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
  k_BKSH, v_BKSH = (a.transpose(0, 2, 1, 3) for a in (k_BSKH, v_BSKH))
  out_BKGTH = _attention(q_BKGTH, k_BKSH, v_BKSH, segments_BT)
  return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)
