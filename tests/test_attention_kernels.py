"""The fused attention kernels against XLA's attention, on the CPU.

Splash (TPU) and Triton (GPU) attention run in Pallas's interpreter here: the
same kernels, blocks and masks an accelerator runs, so a wrong mask or
gradient shows without one. Every check has grouped heads (4 query, 2
key/value), three packed documents per row with their boundaries at different
places in each row, and a partial block (200 positions: 128 + 72)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import lm as lm_experiment
from loopjax import loss, sharding
from loopjax.errors import ConfigError
from loopjax.model import attention_kernels
from loopjax.state import build_model, cast

B, T, N, K, H = 2, 200, 4, 2, 16
FUSED = ("splash", "triton")
DOCS = np.array([[0] * 50 + [1] * 100 + [2] * 50, [0] * 130 + [1] * 20 + [2] * 50])


def qkv(dtype, seed=0):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.normal(size=(B, T, n, H)), dtype) for n in (N, K, K))


def attend(kernel, q, k, v, segments=DOCS):
  seg = None if segments is None else jnp.asarray(segments, jnp.int32)
  return attention_kernels.causal_attention(q, k, v, seg, kernel)


def value_and_grads(kernel, q, k, v, segments=DOCS):
  """The output and d(sum(out * w))/d(q, k, v), in float32."""
  w = jnp.asarray(np.random.default_rng(9).normal(size=(B, T, N, H)), q.dtype)

  def f(q, k, v):
    out = attend(kernel, q, k, v, segments)
    return (out.astype(jnp.float32) * w).sum(), out

  (_, out), grads = jax.value_and_grad(f, (0, 1, 2), has_aux=True)(q, k, v)
  return [np.asarray(a, np.float32) for a in (out, *grads)]


@pytest.mark.parametrize("kernel", FUSED)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_kernel_and_its_gradient_equal_xla_attention(kernel, dtype):
  q, k, v = qkv(dtype)
  ref = value_and_grads("xla", *(a.astype(jnp.float32) for a in (q, k, v)))
  got = value_and_grads(kernel, q, k, v)
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
    scale = np.abs(b).max()
    assert np.abs(a - b).max() <= tol * scale, (name, np.abs(a - b).max(), scale)


@pytest.mark.parametrize("kernel", FUSED)
def test_no_kernel_leaks_across_documents(kernel):
  """Changing document 0's queries, keys and values changes nothing after it;
  without segment ids the same change does reach later documents (so a
  kernel that dropped the ids would fail here)."""
  q, k, v = qkv(jnp.float32)
  q2, k2, v2 = (a.at[:, :50].add(3.0) for a in (q, k, v))
  after = slice(50, None)  # row 0: documents 1 and 2; row 1 ends doc 0 at 130
  a, b = attend(kernel, q, k, v), attend(kernel, q2, k2, v2)
  np.testing.assert_allclose(a[0, after], b[0, after], atol=1e-6)
  np.testing.assert_allclose(a[1, 130:], b[1, 130:], atol=1e-6)
  c, d = attend(kernel, q, k, v, None), attend(kernel, q2, k2, v2, None)
  assert np.abs(c[0, after] - d[0, after]).max() > 1e-2


def test_a_short_window_of_one_document_equals_xla():
  """40 positions in one 128 block, no segment ids: the padded keys stay
  unseen."""
  q, k, v = (a[:, :40] for a in qkv(jnp.float32))
  ref = attention_kernels.causal_attention(q, k, v, None, "xla")
  for kernel in FUSED:
    got = attention_kernels.causal_attention(q, k, v, None, kernel)
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_auto_picks_by_target_batch_and_dtype():
  choose = attention_kernels.choose
  bf16 = jnp.bfloat16
  assert choose("auto", "cpu", 1024, True, bf16) == "blocked"
  assert choose("auto", "tpu", 1024, True, bf16) == "splash"
  assert choose("auto", "tpu", 41, False, bf16) == "xla"  # under one block
  assert choose("auto", "gpu", 1024, True, bf16) == "triton"  # packed documents
  assert choose("auto", "gpu", 1024, False, bf16) == "cudnn"
  assert choose("auto", "gpu", 1024, False, jnp.float32) == "triton"
  assert choose("splash", "cpu", 64, True, bf16) == "splash"  # interpreted
  with pytest.raises(ConfigError, match="splash runs on tpu or cpu"):
    choose("splash", "gpu", 1024, True, bf16)
  with pytest.raises(ConfigError, match="cudnn runs on gpu"):
    choose("cudnn", "cpu", 1024, False, bf16)
  with pytest.raises(ConfigError, match="packed documents"):
    choose("cudnn", "gpu", 1024, True, bf16)
  with pytest.raises(ConfigError, match="computes in bfloat16"):
    choose("cudnn", "gpu", 1024, False, "float32")


def test_fused_kernels_run_per_device_under_a_mesh():
  """Under a (data 4, tensor 2) mesh the kernel runs inside shard_map over
  batch and key/value heads (XLA's partitioner would gather a Pallas call's
  operands whole), with the unsplit result."""
  rules = (("batch", ("data", "fsdp")), ("heads", "tensor"))
  mesh = sharding.make_mesh({"data": 4, "fsdp": 1, "tensor": 2})
  q, k, v = (jnp.concatenate([a, a]) for a in qkv(jnp.float32))
  seg = jnp.asarray(np.concatenate([DOCS, DOCS]), jnp.int32)

  def f(q, k, v, seg):
    with sharding.active(mesh, rules):
      return attention_kernels.causal_attention(q, k, v, seg, "splash")

  assert "shard_map" in str(jax.make_jaxpr(f)(q, k, v, seg))
  ref = attention_kernels.causal_attention(q, k, v, seg, "xla")
  rows = sharding.batch_sharding(mesh, rules)
  got = jax.jit(f)(*(jax.device_put(a, rows) for a in (q, k, v, seg)))
  np.testing.assert_allclose(got, ref, atol=1e-5)


def lm_loss_and_grads(kernel: str, dtype: str):
  """A tiny looped LM's loss on a batch of packed documents, and its
  gradient, with attention by `kernel`, computed in `dtype` from float32
  params as training computes it (`state.cast`): bfloat16 runs its matmuls and
  attention in bfloat16 (asserted on the traced program)."""
  c = lm_experiment.get_config("tiny").model
  c.update(d_model=32, num_heads=4, num_kv_heads=2, dtype=dtype, attention=kernel)
  model = build_model(c, 64, T, seed=0)
  rng = np.random.default_rng(1)
  batch = {
    "inputs": jnp.asarray(rng.integers(0, 64, (B, T)), jnp.int32),
    "targets": jnp.asarray(rng.integers(0, 64, (B, T)), jnp.int32),
    "mask": jnp.ones((B, T), jnp.float32),
    "segments": jnp.asarray(DOCS, jnp.int32),
  }
  train_cfg = lm_experiment.get_config("tiny").train
  graphdef, params = nnx.split(model, nnx.Param)

  def f(params):
    m = nnx.merge(graphdef, cast(params, dtype))
    return loss.lm_loss_fn(m, batch, train_cfg, key=None, num_loops=2)[0]

  program = str(jax.make_jaxpr(f)(params))
  assert ("pallas_call" in program) == (kernel in FUSED)
  bf16_matmuls = [
    x for x in program.splitlines() if "dot_general" in x and "bf16[" in x
  ]
  assert bool(bf16_matmuls) == (dtype == "bfloat16"), kernel
  value, grads = jax.jit(jax.value_and_grad(f))(params)
  return float(value), jax.tree.leaves(grads)


@pytest.mark.parametrize(
  "dtype",
  [pytest.param(d, marks=pytest.mark.slow) for d in ("float32", "bfloat16")],  # ~20 s
)
def test_an_lm_batch_of_packed_documents_has_one_loss_and_gradient(dtype):
  """The training loss and every parameter's gradient through each path:
  XLA's attention (the reference), the CPU's blocked one, splash and Triton."""
  ref_loss, ref_grads = lm_loss_and_grads("xla", dtype)
  tol = 1e-5 if dtype == "float32" else 2e-2
  for kernel in ("blocked", *FUSED):
    got_loss, got_grads = lm_loss_and_grads(kernel, dtype)
    assert abs(got_loss - ref_loss) <= tol * abs(ref_loss), (kernel, got_loss, ref_loss)
    for a, b in zip(got_grads, ref_grads, strict=True):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      assert np.abs(a - b).max() <= 5 * tol * max(np.abs(b).max(), 1e-3), kernel
