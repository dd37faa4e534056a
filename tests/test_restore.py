"""Evaluation, analysis, sampling and lm_eval restore a checkpoint's params
only (`restore.Reader`: orbax's partial restore), never the optimizer's
moments or a grad filter's state; training resumes the whole state. What
orbax reads is counted by TensorStore's own metrics."""

import gc
import re

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from loopjax import checkpoint, restore, sharding, train
from loopjax import task as task_lib
from loopjax.state import sharded_train_state
from loopjax.workdir import Workdir


def arrays_read() -> tuple[int, int]:
  """(keys, bytes) TensorStore has read from storage in this process so far:
  keys read from orbax's OCDBT store (two per array of these sizes: its
  metadata and its one chunk), and the bytes the disk or bucket driver
  returned beneath it."""
  import tensorstore as ts

  keys = bytes_ = 0
  for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"):
    total = sum(v.get("value", 0) for v in m.get("values", []))
    if m["name"] == "/tensorstore/kvstore/ocdbt/read":
      keys += total
    elif re.fullmatch(r"/tensorstore/kvstore/(?!ocdbt/)[^/]+/bytes_read", m["name"]):
      bytes_ += total
  return keys, bytes_


def reading(fn):
  """(fn(), keys read, bytes read) (`arrays_read`)."""
  before = arrays_read()
  out = fn()
  return out, *(after - was for after, was in zip(arrays_read(), before, strict=True))


def nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def same(a, b) -> bool:
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
    bool((x == y).all())
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


class _Position:  # a data iterator's saved position, as checkpoint.save takes it
  def get_state(self):
    return {"position": 3}


def _state(seed=0):
  """A train state's shape: params, an optimizer state 12x their size."""
  k = jax.random.split(jax.random.key(seed), 2)
  params = {"w": jax.random.normal(k[0], (64, 32)), "b": jax.random.normal(k[1], (32,))}
  window = jax.tree.map(lambda p: jnp.ones((10, *p.shape)), params)
  opt = {"mu": jax.tree.map(jnp.ones_like, params), "window": window}
  return {"params": params, "opt_state": opt, "step": jnp.int32(7)}


@pytest.fixture
def saved(tmp_path):
  """(state, checkpoint manager) with the state saved at step 7."""
  mngr = ocp.CheckpointManager(tmp_path / "checkpoints")
  state = _state()
  checkpoint.save(mngr, 7, state, _Position())
  checkpoint.wait(mngr)
  yield state, mngr
  mngr.close()


def test_a_partial_restore_reads_its_part_alone(saved):
  state, mngr = saved
  whole = checkpoint.abstract(state)
  (got, step), keys, read = reading(
    lambda: checkpoint.restore(mngr, {"params": whole["params"]}, partial=True)
  )
  assert step == 7 and same(got, {"params": state["params"]})
  assert keys <= 2 * len(jax.tree.leaves(state["params"]))
  assert read < nbytes(state["params"]) + nbytes(state["opt_state"]) / 4
  (full, _), all_keys, _ = reading(lambda: checkpoint.restore(mngr, whole))
  assert same(full, state) and all_keys > 3 * keys  # training: the whole state


def _shaped(x, shape):
  return jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding)


@pytest.mark.parametrize(
  "change, says",
  [
    (lambda p: p | {"gate": p["b"]}, r"has no \['params'\]\['gate'\]"),
    (lambda p: {"w": p["w"]}, r"holds \['params'\]\['b'\], which this model lacks"),
    pytest.param(  # orbax's other reads, cancelled, warn when collected
      lambda p: p | {"b": _shaped(p["b"], (16,))},
      "not compatible with the stored",
      marks=pytest.mark.filterwarnings(
        "ignore::pytest.PytestUnraisableExceptionWarning"
      ),
    ),
  ],
  ids=["a param it lacks", "a param it holds besides", "a param of another shape"],
)
def test_a_partial_restore_of_another_model_fails(saved, change, says):
  """A model with a param the checkpoint lacks, without one it holds, or
  with one of another shape is not the model saved, as a full restore would
  say."""
  state, mngr = saved
  part = {"params": change(checkpoint.abstract(state)["params"])}
  with pytest.raises(ValueError, match=says):
    checkpoint.restore(mngr, part, step=7, quarantine=False, partial=True)
  with pytest.raises(checkpoint.NoGoodCheckpoint, match=says):
    checkpoint.restore(mngr, part, quarantine=False, partial=True)
  gc.collect()  # orbax's cancelled reads, here rather than in the next test


def test_a_partial_restore_verifies_its_part(saved):
  """The part's checksums are checked as a full restore's are."""
  state, mngr = saved
  part = {"params": checkpoint.abstract(state)["params"]}
  step = mngr.directory / "7"
  meta = ocp.args.JsonRestore()
  sums = mngr.restore(7, args=ocp.args.Composite(meta=meta)).meta
  sums["checksums"]["['params']['w']"] += 1
  (step / "meta" / "metadata").write_text(__import__("json").dumps(sums))
  with pytest.raises(checkpoint.CorruptCheckpoint, match=r"\['params'\]\['w'\]"):
    checkpoint.restore(mngr, part, step=7, quarantine=False, partial=True)


@pytest.fixture(scope="module")
def grokfast_run(tmp_path_factory):
  """A tiny run trained with Grokfast MA: its filter's window (10 params-
  shaped gradients) and AdamW's moments are saved beside the params."""
  from experiments import sysgen

  root = tmp_path_factory.mktemp("grokfast")
  c = sysgen.get_config("tiny")
  c.data.data_dir = str(root / "data")
  c.train.grokfast.update(kind="ma", window=10)
  c.train.num_steps, c.eval_every = 20, 0
  train.train_and_evaluate(c, root / "run")
  return c, root / "run"


@pytest.mark.slow  # ~60 s: a training run
def test_evaluation_of_a_grokfast_run_restores_its_params_only(grokfast_run):
  """The params the trainer saved, read without one array of the optimizer's
  or the filter's: what every mode's restore (`restore.from_checkpoint`,
  `restore.Reader`) reads."""
  config, workdir = grokfast_run
  task = task_lib.for_config(config).load(config)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  whole = sharded_train_state(config, task, mesh, abstract=True)[1]
  mngr = Workdir(workdir).checkpoints(config.checkpoint, read_only=True)
  try:
    (trained, _), all_keys, _ = reading(lambda: checkpoint.restore(mngr, whole))
  finally:
    mngr.close()
  opt = trained["opt_state"]
  assert nbytes(opt) > 10 * nbytes(trained["params"])
  (_, model, step), keys, read = reading(
    lambda: restore.from_checkpoint(config, workdir, task=task)
  )
  assert step == 20 and same(model.params, trained["params"])
  assert keys <= 2 * len(jax.tree.leaves(trained["params"])) < all_keys
  assert read < nbytes(trained["params"]) + nbytes(opt) / 10


def test_a_reading_job_runs_on_the_devices_it_is_launched_on(tiny_config, monkeypatch):
  """A mesh is where a job runs, not part of the model: a run trained on one
  device (mesh.devices=1) is read by a job of several processes on all their
  devices, and a trained mesh that does not fit them keeps what it can."""
  from loopjax.errors import ConfigError

  tiny_config.mesh.update(devices=1, data=-1, fsdp=1, tensor=1)
  monkeypatch.setattr(jax, "process_count", lambda: 2)  # 8 devices, 2 processes
  with pytest.raises(ConfigError, match="mesh.devices"):
    sharding.make_mesh(tiny_config.mesh)  # training's rule: its own mesh only
  assert dict(restore.job_mesh(tiny_config).shape) == {
    "data": 8,
    "fsdp": 1,
    "tensor": 1,
  }
  tiny_config.mesh.update(data=1, fsdp=2, tensor=2)  # trained on 4 devices
  assert dict(restore.job_mesh(tiny_config).shape) == {
    "data": 2,
    "fsdp": 2,
    "tensor": 2,
  }
  tiny_config.mesh.update(fsdp=3)  # 3 does not divide 8: data alone
  assert dict(restore.job_mesh(tiny_config).shape) == {
    "data": 8,
    "fsdp": 1,
    "tensor": 1,
  }
  monkeypatch.setattr(jax, "process_count", lambda: 1)  # one process: mesh.devices
  assert restore.job_mesh(tiny_config).devices.size == 1
