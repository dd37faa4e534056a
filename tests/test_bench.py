"""Benchmarks run and measure what they claim (speed itself is not tested here)."""

import importlib.util
import sys

import pytest
from conftest import in_process

from experiments import bench, sysgen
from loopjax.bench import first_step, steps


def small(num_loops: int, d_model: int = 16):
  c = bench.get_config("default")
  c.model.update(d_model=d_model, num_heads=2, num_loops=num_loops)
  c.train.batch_size = 8
  c.bench.update(warmup=1, steps=2, repeats=1)
  return c


@pytest.mark.slow  # ~14 s of compiles
def test_jax_step_measures_compile_time_flops_and_memory():
  r2, r4 = steps.jax_step(small(2, 64)), steps.jax_step(small(4, 64))
  for r in (r2, r4):
    assert r["compile_s"] > 0 and r["step_s"] > 0 and r["peak_bytes"] > 0
  # The core dominates the FLOPs, so twice the iterations is close to twice the work.
  assert 1.6 < r4["xla_flops"] / r2["xla_flops"] < 2.05
  # Our count agrees with XLA's where XLA sees every iteration (fully unrolled).
  for r in (r2, r4):
    assert 0.8 < r["flops"] / r["xla_flops"] < 1.25


@pytest.mark.skipif(
  importlib.util.find_spec("torch") is None,
  reason="the PyTorch reference needs the `bench` extra",
)
def test_torch_reference_runs_the_same_shapes():
  out = steps.side_by_side(small(2), torch=True)
  assert out["torch"]["step_s"] > 0 and len(out["torch"]["windows_s"]) == 1


@pytest.mark.skipif(
  importlib.util.find_spec("torch") is None,
  reason="the PyTorch reference needs the `bench` extra",
)
def test_torch_reference_computes_the_same_function():
  """With loopjax's weights copied in, the PyTorch model gives the same logits."""
  import numpy as np
  import torch
  from flax import nnx

  from loopjax.bench import torch_ref
  from loopjax.bench.measure import random_batch
  from loopjax.state import build_model

  c = small(3)
  c.model.injection = "add"
  V, T = steps.dims(c)
  jax_model = build_model(c.model, V, T, 0)
  p = nnx.to_pure_dict(nnx.state(jax_model, nnx.Param))
  t = lambda a: torch.as_tensor(np.array(a))  # noqa: E731
  ref = torch_ref.LoopedTransformer(c.model, V, T)
  with torch.no_grad():
    ref.embed.copy_(t(p["embed"]))
    ref.pos.copy_(t(p["pos"]))
    ref.norm.weight.copy_(t(p["norm"]["scale"]))
    ref.norm.bias.copy_(t(p["norm"]["bias"]))
    for block, w in zip(ref.core, p["core"].values(), strict=True):
      D = c.model.d_model
      block.qkv.weight.copy_(t(w["attn"]["wqkv"]).reshape(D, 3 * D).T)
      block.qkv.bias.copy_(t(w["attn"]["bqkv"]).reshape(3 * D))
      block.out.weight.copy_(t(w["attn"]["wo"]).reshape(D, D).T)
      block.out.bias.copy_(t(w["attn"]["bo"]))
      block.fc1.weight.copy_(t(w["mlp"]["w1"]).T)
      block.fc1.bias.copy_(t(w["mlp"]["b1"]))
      block.fc2.weight.copy_(t(w["mlp"]["w2"]).T)
      block.fc2.bias.copy_(t(w["mlp"]["b2"]))
      for name in ("norm1", "norm2"):
        getattr(block, name).weight.copy_(t(w[name]["scale"]))
        getattr(block, name).bias.copy_(t(w[name]["bias"]))
  batch = random_batch(c, V, T)
  expected = jax_model(batch["inputs"], batch["answer_pos"])
  tb = torch_ref.to_torch(batch)
  got = ref(tb["inputs"], tb["answer_pos"]).detach().numpy()
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(
  importlib.util.find_spec("torch") is None,
  reason="the PyTorch reference needs the `bench` extra",
)
def test_torch_reference_computes_the_same_language_model():
  """The LM shape (rope, RMSNorm, logits at every position), weights copied in."""
  import numpy as np
  import torch
  from flax import nnx

  from experiments import lm
  from loopjax.bench import torch_ref
  from loopjax.bench.measure import random_batch
  from loopjax.state import build_model

  c = lm.get_config("tiny")
  c.data.seq_len = 12
  V, T = steps.dims(c)
  jax_model = build_model(c.model, V, T, 0)
  p = nnx.to_pure_dict(nnx.state(jax_model, nnx.Param))
  t = lambda a: torch.as_tensor(np.array(a))  # noqa: E731
  ref = torch_ref.LoopedTransformer(c.model, V, T)
  D = c.model.d_model
  with torch.no_grad():
    ref.embed.copy_(t(p["embed"]))
    ref.norm.weight.copy_(t(p["norm"]["scale"]))
    for block, w in zip(ref.core, p["core"].values(), strict=True):
      block.qkv.weight.copy_(t(w["attn"]["wqkv"]).reshape(D, 3 * D).T)
      block.qkv.bias.copy_(t(w["attn"]["bqkv"]).reshape(3 * D))
      block.out.weight.copy_(t(w["attn"]["wo"]).reshape(D, D).T)
      block.out.bias.copy_(t(w["attn"]["bo"]))
      block.fc1.weight.copy_(t(w["mlp"]["w1"]).T)
      block.fc1.bias.copy_(t(w["mlp"]["b1"]))
      block.fc2.weight.copy_(t(w["mlp"]["w2"]).T)
      block.fc2.bias.copy_(t(w["mlp"]["b2"]))
      block.norm1.weight.copy_(t(w["norm1"]["scale"]))
      block.norm2.weight.copy_(t(w["norm2"]["scale"]))
  batch = random_batch(c, V, T)
  expected = jax_model(batch["inputs"], None)
  got = ref(torch.as_tensor(batch["inputs"]).long()).detach().numpy()
  assert got.shape == (c.train.batch_size, T, V)
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
  step = torch_ref.make_train_step(c, V, T)
  assert float(step(torch_ref.to_torch(batch))) > 0


@pytest.mark.slow  # three runs as processes, ~40 s
def test_first_step_times_a_fresh_start_and_two_restarts(tmp_path):
  data_dir = tmp_path / "data"
  args = ["--config=experiments/sysgen.py:tiny", f"--config.data.data_dir={data_dir}"]
  config = sysgen.get_config("tiny")
  config.data.data_dir = str(data_dir)
  rows = first_step.bench(config, args)["rows"]
  assert [r["start"] for r in rows] == ["fresh", "restart", "restart, no cache"]
  assert all(r["to_first_step_s"] > r["compile_s"] > 0 for r in rows)
  fresh, restart, no_cache = (r["compile_s"] for r in rows)
  assert restart < fresh and restart < no_cache  # loaded, not compiled


@pytest.mark.parametrize(
  "args, says",
  [
    (["bogus", "--config=experiments/bench.py"], "expected one benchmark"),
    (
      ["step", "--config=experiments/bench.py", "--config.model.d_model=-1"],
      "model.d_model: must be >= 1",
    ),
    (["step", "--config=experiments/nope.py"], "cannot load the config file"),
    (["step"], "step: --config is required"),
    (
      ["step", "--config=experiments/extrapolation.py"],
      "step: the config has no `bench` section",
    ),
  ],
)  # in this process (conftest.in_process): a process each would start JAX
def test_a_bad_benchmark_command_is_one_line(args, says):
  r = in_process([sys.executable, "-m", "loopjax.bench", *args])
  assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
  assert r.stderr.startswith("error: ") and says in r.stderr, r.stderr
