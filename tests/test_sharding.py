"""Meshes, parameter specs, and sharded training equal to one device (8 CPUs)."""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

from loopjax import checkpoint, sharding
from loopjax.data import kg, pipeline
from loopjax.errors import ConfigError
from loopjax.kg import source as kg_source
from loopjax.state import sharded_train_state, train_state
from loopjax.train import make_train_step
from loopjax.workdir import Workdir

GOLDEN = Path(__file__).parent / "golden"
MESHES = [  # data x fsdp x tensor; the 3-axis one in the default suite (~9 s each)
  pytest.param((8, 1, 1), marks=pytest.mark.slow),
  (2, 2, 2),
  pytest.param((1, 4, 2), marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  from experiments import sysgen

  c = sysgen.get_config("tiny")
  c.data.data_dir = str(tmp_path_factory.mktemp("data"))
  return c, kg_source.knowledge_graph(c.data)


def _mesh(config, shape, devices=None):
  config = config.copy_and_resolve_references()
  config.mesh.update(dict(zip(sharding.MESH_AXES, shape, strict=True)), devices=0)
  return sharding.make_mesh(config.mesh, devices), config


@pytest.mark.parametrize(
  "sizes,devices,want",
  [((-1, 1, 1), 8, (8, 1, 1)), ((2, -1, 2), 8, (2, 2, 2)), ((1, 1, -1), 2, (1, 1, 2))],
)
def test_mesh_fills_the_remaining_devices(sizes, devices, want):
  cfg = dict(zip(sharding.MESH_AXES, sizes, strict=True))
  assert sharding.mesh_shape(cfg, devices) == want


@pytest.mark.parametrize(
  "sizes,message",
  [
    ((3, 1, -1), "mesh: data x fsdp x tensor must equal the 8 devices; got data=3"),
    ((2, 2, 1), "mesh: data x fsdp x tensor must equal the 8 devices"),
  ],
)
def test_bad_mesh_names_the_field(sizes, message):
  with pytest.raises(ConfigError, match=message):
    sharding.mesh_shape(dict(zip(sharding.MESH_AXES, sizes, strict=True)), 8)


def _batches(config, task, n):
  it = pipeline.train_iterator(
    kg.train_split(task, config.data.train_hops),
    config.train.batch_size,
    0,
    task.vocab.pad_id,
  )
  return [next(it) for _ in range(n)]


@pytest.fixture(scope="module")
def single_device(setup):
  """Three steps on one device: the reference."""
  config, task = setup
  graphdef, state, tx = train_state(config, task)
  step = make_train_step(config, graphdef, tx)
  out = []
  for batch in _batches(config, task, 3):
    state, m = step(state, batch)
    out.append(jax.device_get(m))
  return jax.device_get(state), out


@pytest.mark.parametrize("shape", MESHES)
def test_sharded_steps_match_one_device(setup, single_device, shape):
  config, task = setup
  mesh, config = _mesh(config, shape)
  graphdef, state, tx, shardings = sharded_train_state(config, task, mesh)
  wqkv = state["params"]["core"][0]["attn"]["wqkv"]
  assert wqkv.sharding.spec == jax.sharding.PartitionSpec("fsdp", None, "tensor", None)
  step = make_train_step(config, graphdef, tx, mesh, shardings)
  put = sharding.batch_sharding(mesh, config.sharding.rules)
  for batch, want in zip(_batches(config, task, 3), single_device[1], strict=True):
    state, m = step(state, sharding.global_batch(batch, put, config.train.batch_size))
    for k, v in want.items():
      np.testing.assert_allclose(m[k], v, rtol=2e-5, atol=1e-6, err_msg=k)
  assert state["params"]["embed"].sharding == shardings["params"]["embed"]
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
    jax.device_get(state["params"]),
    single_device[0]["params"],
  )


def _specs(config, task, shape) -> dict:
  mesh, config = _mesh(config, shape)
  config.model.update(num_prelude=1, num_coda=1, injection="concat")  # every kind
  shardings = sharded_train_state(config, task, mesh, abstract=True)[3]
  flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
  return {
    jax.tree_util.keystr(path): [list(a) if isinstance(a, tuple) else a for a in s.spec]
    for path, s in flat
  }


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 4, 2)])
def test_state_specs_match_golden_files(setup, shape):
  """Specs of every state leaf. After an intended change of the rules or the
  model, regenerate with LOOPJAX_UPDATE_GOLDEN=1 pytest tests/test_sharding.py
  and review the diff of tests/golden/."""
  config, task = setup
  got = _specs(config, task, shape)
  path = GOLDEN / f"specs_{'x'.join(map(str, shape))}.json"
  if os.environ.get("LOOPJAX_UPDATE_GOLDEN"):
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
  want = json.loads(path.read_text())
  changed = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
  assert not changed, (
    f"{len(changed)} state specs differ from {path.name}, e.g. {changed[0]}: "
    f"{want.get(changed[0])} -> {got.get(changed[0])}. If intended, rerun with "
    "LOOPJAX_UPDATE_GOLDEN=1 and commit tests/golden/"
  )
  # Optimizer scalars and the step are replicated, moments follow their params.
  assert got["['step']"] == [] and got["['rng']"] == []
  counts = [k for k in got if k.endswith(".count")]
  assert counts and all(got[k] == [] for k in counts)


def test_checkpoint_restores_on_another_mesh(setup, tmp_path):
  """Saved from 8 devices as 4 x 2 (data x fsdp), restored on 2 devices and 1."""
  config, task = setup
  mesh, config = _mesh(config, (4, 2, 1))
  _, state, _, _ = sharded_train_state(config, task, mesh)
  mngr = Workdir(tmp_path).checkpoints(config.checkpoint)
  it = pipeline.train_iterator(
    kg.train_split(task, config.data.train_hops),
    config.train.batch_size,
    0,
    task.vocab.pad_id,
  )
  checkpoint.save(mngr, 1, state, it)
  checkpoint.wait(mngr)
  want = jax.device_get(state)
  for shape, devices in (
    ((1, 2, 1), jax.devices()[:2]),
    ((1, 1, 1), jax.devices()[:1]),
  ):
    small, cfg = _mesh(config, shape, devices)
    _, target, _, _ = sharded_train_state(cfg, task, small, abstract=True)
    got, step = checkpoint.restore(mngr, target, it, step=1)
    assert step == 1
    embed = got["params"]["embed"]
    assert embed.sharding.mesh.devices.size == len(devices)
    jax.tree.map(
      np.testing.assert_array_equal, jax.device_get(got["params"]), want["params"]
    )
  mngr.close()


RULES = (("batch", ("data", "fsdp")),)


def _fed_batches(mesh, process_of, B: int, steps: int, rows: int = 512):
  """The global batches the processes of `mesh` feed (each process's device
  slices, filled from its group's stream in row order), with the groups."""
  groups = sharding.row_groups(mesh, RULES, B, process_of)
  index_map = sharding.batch_sharding(mesh, RULES).devices_indices_map((B,))
  spans = {}
  for device, index in index_map.items():
    spans.setdefault(process_of(device), set()).add(index[0].indices(B)[:2])
  out = np.full((steps, B), -1)
  for p, shard in groups.items():
    local = np.concatenate([np.arange(a, b) for a, b in sorted(spans[p])])
    it = pipeline.shuffled_batches(np.arange(rows), B, 0, lambda idx: idx, shard)
    for s in range(steps):
      fed = next(it)
      assert (out[s, local] == -1).all() or (out[s, local] == fed).all()  # replicas
      out[s, local] = fed
  return out, groups


@pytest.mark.parametrize("layout", ["torus", "host-major"])
def test_each_process_feeds_its_rows_wherever_the_mesh_puts_its_devices(layout):
  """4 processes of 2 devices (process = device id // 2). In a torus-like
  order each process's devices hold two separate blocks of the batch; every
  global batch is still fed exactly once, a new set of examples each step."""
  ids = (0, 2, 4, 6, 1, 3, 5, 7) if layout == "torus" else range(8)
  devices = [jax.devices()[i] for i in ids]
  mesh = jax.make_mesh(
    (8, 1, 1),
    sharding.MESH_AXES,
    axis_types=(jax.sharding.AxisType.Auto,) * 3,
    devices=devices,
  )
  fed, groups = _fed_batches(mesh, lambda d: d.id // 2, B=64, steps=8)
  assert sorted(groups.values()) == [(g, 4) for g in range(4)]
  if layout == "host-major":  # one block each, as before: block k is group k
    assert groups == {p: (p, 4) for p in range(4)}
  for batch in fed:
    assert (batch >= 0).all() and len(set(batch)) == 64
  assert len(set(fed.ravel())) == 8 * 64  # an epoch of 512: no example twice


def test_processes_holding_the_same_rows_form_one_group():
  """A tensor axis across processes: process 2k + t holds data rows 2k, 2k + 1
  at tensor index t, so processes 2k and 2k + 1 hold the same rows of the
  batch, feed the same examples, and are one group."""
  mesh = jax.make_mesh(
    (4, 1, 2), sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3
  )
  owner = {mesh.devices[i, 0, t]: 2 * (i // 2) + t for i in range(4) for t in range(2)}
  fed, groups = _fed_batches(mesh, owner.get, B=16, steps=4)
  assert groups == {0: (0, 2), 1: (0, 2), 2: (1, 2), 3: (1, 2)}
  assert all(len(set(batch)) == 16 for batch in fed)


@pytest.mark.slow
def test_a_v5e_slices_hosts_each_feed_their_rows(monkeypatch):
  """libtpu's compile-only v5e 4x4 (4 hosts x 4 chips): jax.make_mesh puts one
  host's chips at separate rows of the batch; every mesh still starts, each
  host feeding its own rows (the `tpu` extra; skipped without it)."""
  pytest.importorskip("libtpu")
  from jax.experimental import topologies

  hosts = ",".join(["localhost"] * 4)
  for k, v in dict(
    TPU_SKIP_MDS_QUERY="1",  # off a TPU VM: no metadata server to wait for
    TPU_ACCELERATOR_TYPE="v5litepod-16",
    TPU_WORKER_HOSTNAMES=hosts,
    TPU_WORKER_ID="0",
  ).items():
    monkeypatch.setenv(k, v)
  devices = topologies.get_topology_desc("v5e:4x4", "tpu").devices
  for shape in [(4, 4, 1), (1, 16, 1), (2, 4, 2)]:
    mesh = jax.make_mesh(
      shape,
      sharding.MESH_AXES,
      axis_types=(jax.sharding.AxisType.Auto,) * 3,
      devices=devices,
    )
    fed, groups = _fed_batches(mesh, lambda d: d.process_index, B=64, steps=4)
    assert sorted(groups.values()) == [(g, 4) for g in range(4)]
    assert all(len(set(batch)) == 64 for batch in fed)
