"""Causal attention without the weights, by the kernel the compile target runs.

`model.attention` names it; "auto" picks by the platform compiled for
(`sharding.platform()`), the sequence length and the batch:

  cpu   `blocked`: query blocks with a recomputing backward (blocked_attention)
  tpu   `splash`: Pallas splash attention, causal, packed documents by segment ids
  gpu   `cudnn`: cuDNN's flash attention, for bf16 batches without packed
        documents (it takes no segment ids: given them it would attend across
        documents); `triton`: Pallas's Triton flash attention with segment ids
        for the rest

Below one 128-token block the accelerators use `xla` (jax.nn.dot_product_attention,
XLA's own: the reference every kernel is tested against): a (T, T) score
tile that small costs nothing to hold. None of the fused kernels keeps the
(B, N, T, S) weights: each saves its output and one logsumexp per query and
recomputes the weights block by block in the backward pass.

Pallas kernels are opaque to XLA's partitioner, which would gather their
operands whole; they run per device (`sharding.per_shard`), over the batch and,
where the mesh splits them, the key/value heads. On a CPU the TPU and GPU
kernels run in Pallas's interpreter: slow, but the same kernel, which is how
the tests check their numerics without an accelerator.
"""

import functools

import jax
import jax.numpy as jnp

from loopjax import sharding
from loopjax.errors import ConfigError
from loopjax.model import blocked_attention

# Where each fused kernel runs; on "cpu" the Pallas ones are interpreted.
RUNS_ON = {"splash": ("tpu", "cpu"), "triton": ("gpu", "cpu"), "cudnn": ("gpu",)}
BLOCK = 128  # the fused kernels' tile along the sequence; shorter ones use xla
HALF = (jnp.dtype("bfloat16"), jnp.dtype("float16"))  # what cuDNN computes in


def choose(kernel: str, platform: str, T: int, packed: bool, dtype) -> str:
  """The kernel `kernel` ("auto" or a name) resolves to for this call; one
  the call cannot run is a ConfigError (`footprint.check` asks first, before
  a train step compiles; aot and the other modes when they trace)."""
  if kernel != "auto":
    if platform not in RUNS_ON.get(kernel, (platform,)):
      raise ConfigError(
        f"model.attention: {kernel} runs on {' or '.join(RUNS_ON[kernel])}; this "
        f"program is compiled for {platform} (use auto)"
      )
    if kernel == "cudnn" and packed:
      raise ConfigError(
        "model.attention: cudnn cannot keep packed documents apart; set "
        "model.document_mask=False or use triton"
      )
    if kernel == "cudnn" and jnp.dtype(dtype) not in HALF:
      raise ConfigError(
        "model.attention: cudnn's flash attention computes in bfloat16; set "
        f"model.dtype=bfloat16 or use triton; got {jnp.dtype(dtype).name}"
      )
    return kernel
  if platform == "cpu":
    return "blocked"
  if T < BLOCK or platform not in ("tpu", "gpu"):
    return "xla"
  if platform == "tpu":
    return "splash"
  return "cudnn" if not packed and jnp.dtype(dtype) in HALF else "triton"


def causal_attention(q_BTNH, k_BSKH, v_BSKH, segments_BT=None, kernel="auto"):
  """softmax(q k^T / sqrt(H)) v over each query's earlier keys, within its
  segment where `segments_BT` (packed documents): (B, T, N, H). Query heads
  k*G .. k*G + G - 1 share key/value head k."""
  platform = sharding.platform()
  T = q_BTNH.shape[1]
  name = choose(kernel, platform, T, segments_BT is not None, q_BTNH.dtype)
  if name == "blocked":  # segment ids compared per block: no (T, T) mask
    return blocked_attention.causal_attention(q_BTNH, k_BSKH, v_BSKH, segments_BT)
  if name == "xla":
    seg = segments_BT
    mask = None if seg is None else seg[:, None, :, None] == seg[:, None, None]
    return jax.nn.dot_product_attention(
      q_BTNH, k_BSKH, v_BSKH, mask=mask, is_causal=True
    )
  if name == "cudnn":  # an XLA custom call the partitioner splits itself
    return jax.nn.dot_product_attention(
      q_BTNH, k_BSKH, v_BSKH, is_causal=True, implementation="cudnn"
    )
  B, _, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
  fused = functools.partial(
    _splash if name == "splash" else _triton, interpret=platform == "cpu"
  )
  heads = ("batch", None, "heads", None)
  args = (q_BTKGH, k_BSKH, v_BSKH) + (() if segments_BT is None else (segments_BT,))
  axes = (heads + (None,), heads, heads, ("batch", None))[: len(args)]
  out_BTKGH = sharding.per_shard(fused, axes)(*args)
  return out_BTKGH.reshape(B, T, N, H)


def _padded(a, T: int, mode: str = "constant"):
  """`a` (B, t, ...) padded at the end of its sequence axis to T.

  Safe for causal attention: a real query never sees a later key. A padded
  query's segment repeats the last one (`edge`), so it sees some key and its
  (discarded) row stays finite."""
  pad = [(0, 0)] * a.ndim
  pad[1] = (0, T - a.shape[1])
  return jnp.pad(a, pad, mode=mode)


def _blocks(T: int) -> int:
  return -(-T // BLOCK) * BLOCK


@functools.lru_cache(maxsize=32)
def _splash_kernel(T: int, groups: int, interpret: bool):
  """Splash attention for one sequence's G query heads over one key/value
  head (its MQA form; grouped heads are vmapped over key/value heads)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  mask = sa.MultiHeadMask([sa.CausalMask((T, T))] * groups)
  # Its mask tables are concrete arrays even when first asked for inside a
  # trace: a cached tracer would leak into the next program that uses it.
  with jax.ensure_compile_time_eval():
    return sa.make_splash_mqa_single_device(
      mask, block_sizes=sa.BlockSizes.get_default(), interpret=interpret
    )


def _splash(q_BTKGH, k_BSKH, v_BSKH, segments_BT=None, *, interpret: bool):
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  B, T, K, G, H = q_BTKGH.shape
  P = _blocks(T)
  kernel = _splash_kernel(P, G, interpret)
  # splash takes (heads, T, H) per sequence and does not scale the scores
  q_BKGPH = _padded(q_BTKGH * H**-0.5, P).transpose(0, 2, 3, 1, 4)
  k_BKPH, v_BKPH = (_padded(a, P).transpose(0, 2, 1, 3) for a in (k_BSKH, v_BSKH))

  def one(q_GPH, k_PH, v_PH, seg_P):
    ids = None if seg_P is None else sa.SegmentIds(q=seg_P, kv=seg_P)
    return kernel(q_GPH, k_PH, v_PH, segment_ids=ids)

  seg_BP = None if segments_BT is None else _padded(segments_BT, P, "edge")
  per_head = jax.vmap(one, (0, 0, 0, None))
  out_BKGPH = jax.vmap(per_head, (0, 0, 0, None if seg_BP is None else 0))(
    q_BKGPH, k_BKPH, v_BKPH, seg_BP
  )
  return out_BKGPH.transpose(0, 3, 1, 2, 4)[:, :T]


def _triton(q_BTKGH, k_BSKH, v_BSKH, segments_BT=None, *, interpret: bool):
  from jax.experimental.pallas.ops.gpu import attention

  B, T, K, G, H = q_BTKGH.shape
  P = _blocks(T)
  # the kernel wants as many key/value heads as query heads: (B, P, K*G, H)
  q_BPNH = _padded(q_BTKGH, P).reshape(B, P, K * G, H)
  k_BPNH, v_BPNH = (_padded(jnp.repeat(a, G, axis=2), P) for a in (k_BSKH, v_BSKH))
  seg_BP = None if segments_BT is None else _padded(segments_BT, P, "edge")
  out_BPNH = attention.mha(
    q_BPNH,
    k_BPNH,
    v_BPNH,
    seg_BP,
    sm_scale=H**-0.5,
    causal=True,
    interpret=interpret,
  )
  return out_BPNH[:, :T].reshape(B, T, K, G, H)
