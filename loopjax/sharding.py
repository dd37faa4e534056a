"""Device meshes, logical-axis rules, and the shardings of the train state.

Every parameter carries logical axis names (`vocab`, `embed`, `heads`, `kv`,
`mlp`: model/layers.py); activations name `batch`. `config.sharding.rules` maps
each name to mesh axes (`data`, `fsdp`, `tensor`; config.mesh gives their sizes,
-1 = the remaining devices): data parallel over `data`, FSDP (parameters and
optimizer state split over `fsdp`, gathered by XLA where used) and tensor
parallel attention heads and MLP over `tensor`. A dimension a mesh axis does not
divide stays whole (replicated over that axis), so one config serves any mesh.
Shardings are jax's own (`jax.jit` in/out shardings, `NamedSharding`,
`with_sharding_constraint`); nothing here moves data by hand.
"""

import contextlib
import contextvars
import math
from typing import NamedTuple

import jax
import numpy as np
import optax
from flax import nnx
from flax.core import spmd
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from loopjax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")
_NO_MESH = jax.sharding.AbstractMesh((), ())
_PLATFORM = contextvars.ContextVar("platform", default=None)


def initialize(
  distributed: bool = False,
  coordinator: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  heartbeat_s: int = 60,
) -> None:
  """Joins a multi-process run (`jax.distributed`), or does nothing alone.

  An explicit coordinator ("host:port", with the process count and this
  process's id) is used as given; `distributed` alone lets JAX detect the
  cluster (TPU VM slices, SLURM job steps: the launchers pass it). Asked for,
  never guessed from the environment: a lone process in an salloc shell must
  not wait for peers. A peer that stops answering for `heartbeat_s` seconds
  ends every process with the coordination service's error, not a hang.
  """
  if not distributed and coordinator is None:
    if num_processes or process_id is not None:
      raise ConfigError(
        "--num_processes/--process_id: need --coordinator_address (or "
        "--distributed, to take them from the cluster)"
      )
    return
  # CPU processes reach each other's devices through gloo (tests, laptops);
  # accelerators' collectives do not read this.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=coordinator,
    num_processes=num_processes,
    process_id=process_id,
    heartbeat_timeout_seconds=heartbeat_s,
  )


def mesh_shape(mesh_cfg, num_devices: int) -> tuple[int, ...]:
  """(data, fsdp, tensor) sizes for `num_devices`; a -1 (config.validate allows
  one) is the rest."""
  sizes = [int(mesh_cfg[a]) for a in MESH_AXES]
  named = ", ".join(f"{a}={s}" for a, s in zip(MESH_AXES, sizes, strict=True))
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes and num_devices % known == 0:
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ConfigError(
      f"mesh: data x fsdp x tensor must equal the {num_devices} devices; got {named}"
    )
  return tuple(sizes)


def make_mesh(mesh_cfg, devices=None) -> jax.sharding.Mesh:
  """The mesh over `devices`, by default this run's: all of them, or the first
  `mesh.devices` (one process only)."""
  if devices is None:
    n = mesh_cfg.get("devices", 0)
    if n and jax.process_count() > 1:
      raise ConfigError(
        f"mesh.devices: must be 0 (all) with several processes; got {n}"
      )
    devices = jax.devices()[:n] if n else jax.devices()
  shape = mesh_shape(mesh_cfg, len(devices))
  return jax.make_mesh(
    shape,
    MESH_AXES,
    axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
    devices=devices,
  )


def spec(logical, rules, shape=None, mesh=None) -> PartitionSpec:
  """PartitionSpec of an array with these logical axis names. With `shape` and
  `mesh`, a mesh axis that does not divide its dimension is dropped."""
  table = dict(rules)
  out = []
  for i, name in enumerate(logical):
    axes = table.get(name) if name is not None else None
    if isinstance(axes, list):  # a rule read back from JSON
      axes = tuple(axes)
    if axes is not None and shape is not None:
      size = math.prod(
        mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,))
      )
      if shape[i] % size:
        axes = None
    out.append(axes)
  used = [
    a for axes in out if axes for a in (axes if isinstance(axes, tuple) else (axes,))
  ]
  if twice := sorted({a for a in used if used.count(a) > 1}):
    raise ConfigError(
      f"sharding.rules: {', '.join(map(str, logical))} would split one tensor "
      f"over mesh axis {', '.join(twice)} twice; map the names a tensor has "
      "together to different mesh axes"
    )
  return PartitionSpec(*out)


def param_axes(abstract_model) -> dict:
  """Logical axis names of every parameter, as a plain dict like the params."""
  _, params = nnx.split(abstract_model, nnx.Param)
  return nnx.to_pure_dict(
    jax.tree.map(
      lambda v: v.replace(v.get_metadata()["out_sharding"]),
      params,
      is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
  )


def state_shardings(abstract_state, axes, tx, mesh, rules) -> dict:
  """NamedShardings of the train state: params by their axes, optimizer moments
  like their params (copies of a param stacked on leading axes, as Grokfast
  MA's window: those axes whole), every scalar (step, rng, counts, stage)
  replicated."""

  def named(p):
    return NamedSharding(mesh, p)

  params = jax.tree.map(
    lambda a, x: named(spec(a, rules, x.shape, mesh)),
    axes,
    abstract_state["params"],
    is_leaf=lambda a: isinstance(a, tuple),
  )

  def like(x, s, p):  # x: a state leaf for the param p sharded as s
    lead = (None,) * (len(x.shape) - len(p.shape))
    return named(PartitionSpec(*lead, *s.spec)) if lead else s

  opt = optax.tree_map_params(
    tx,
    like,
    abstract_state["opt_state"],
    params,
    abstract_state["params"],
    transform_non_params=lambda _: named(PartitionSpec()),
  )
  rest = {
    k: named(PartitionSpec())
    for k in abstract_state
    if k not in ("params", "opt_state")
  }
  return {"params": params, "opt_state": opt} | rest


def batch_split(mesh, rules) -> int:
  """How many ways a batch is split: the product of its mesh axes' sizes."""
  axes = spec(("batch",), rules)[0]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


def eval_batch(mesh, rules, batch_size: int, rows: int | None = None) -> int:
  """An evaluation's batch: `batch_size` rows (at most the `rows` there are)
  rounded up to a multiple of the batch's split (no mesh: 1), so each device
  holds as many; the evaluators pad the last batch."""
  split = 1 if mesh is None else batch_split(mesh, rules)
  n = batch_size if rows is None else min(batch_size, rows)
  return split * math.ceil(n / split)


def row_groups(
  mesh, rules, batch_size: int, process_of=lambda d: d.process_index
) -> dict[int, tuple[int, int]]:
  """{process: (group, groups)}: the processes whose devices hold the same rows
  of a global batch form a group (replicas over a mesh axis outside the batch
  rule); group g of G feeds its B / G rows, wherever they lie in the batch.

  A process's rows need not be one block: `jax.make_mesh` orders a multi-host
  TPU slice's chips by their place in the torus, so one host's chips may hold
  rows (0, 4), (4, 8), (24, 28) and (60, 64). They are fed in row order
  (`global_batch`). Groups are numbered by their first row, so a process whose
  rows are one block [k n, (k + 1) n) feeds group k."""
  held: dict[int, list] = {}
  index_map = batch_sharding(mesh, rules).devices_indices_map((batch_size,))
  for device, index in index_map.items():
    held.setdefault(process_of(device), []).append(index[0].indices(batch_size)[:2])
  spans = {p: _merged(rows) for p, rows in held.items()}
  groups = sorted(set(spans.values()))
  every = sorted(span for g in groups for span in g)
  sizes = {sum(b - a for a, b in g) for g in groups}
  covered = sum(b - a for a, b in every) == batch_size  # with the next: once each
  if not covered or _merged(every) != ((0, batch_size),) or len(sizes) != 1:
    raise ConfigError(  # a non-uniform sharding: no mesh make_mesh builds
      f"mesh: the processes' devices hold overlapping or unequal rows of the "
      f"batch ({sorted(spans.items())[:4]}); use a mesh whose data and fsdp "
      "axes split the batch evenly"
    )
  return {p: (groups.index(g), len(groups)) for p, g in spans.items()}


def _merged(spans) -> tuple[tuple[int, int], ...]:
  """Row spans, sorted, adjacent ones joined."""
  out = []
  for a, b in sorted(set(spans)):
    if out and out[-1][1] == a:
      out[-1] = (out[-1][0], b)
    else:
      out.append((a, b))
  return tuple(out)


def writes() -> bool:
  """Whether this process writes the files and prints the lines that every
  process computed alike (reports, checkpoints' side files, logs): process 0."""
  return jax.process_index() == 0


def process_rows(mesh, rules, batch_size: int) -> tuple[int, int]:
  """(group, groups) of this process (`row_groups`)."""
  return row_groups(mesh, rules, batch_size)[jax.process_index()]


def batch_sharding(mesh, rules) -> NamedSharding:
  """Batches: examples split over the `batch` rule's mesh axes."""
  return NamedSharding(mesh, spec(("batch",), rules))


def global_batch(batch: dict, sharding: NamedSharding, batch_size: int) -> dict:
  """One global array per column from this process's rows: its devices' slices
  of the batch in row order, one or several spans (`row_groups`)."""
  return jax.tree.map(
    lambda x: jax.make_array_from_process_local_data(
      sharding, np.asarray(x), (batch_size, *np.shape(x)[1:])
    ),
    batch,
  )


@contextlib.contextmanager
def active(mesh, rules):
  """Within (while a step is traced): `constrain` shards by `mesh` and `rules`,
  through JAX's mesh context and flax's logical-axis rules. Entered inside the
  jitted functions themselves, so a compiled step never depends on where it is
  called from; mesh None: nothing is constrained, whatever the caller set."""
  abstract = _NO_MESH if mesh is None else mesh.abstract_mesh
  token = _PLATFORM.set(None if mesh is None else mesh.devices.flat[0].platform)
  try:
    with jax.sharding.use_abstract_mesh(abstract), nnx.logical_axis_rules(tuple(rules)):
      yield
  finally:
    _PLATFORM.reset(token)


def platform() -> str:
  """The platform being compiled for: the active mesh's devices' (a TPU slice's
  compile-only chips, from a CPU host), else JAX's default backend. Kernels
  are chosen by this, never by the host the code happens to run on."""
  return _PLATFORM.get() or jax.default_backend()


def constrain(x, logical):
  """`x` constrained to the sharding its logical axes get under the current mesh
  and logical-axis rules; unchanged without both."""
  mesh, rules = jax.sharding.get_abstract_mesh(), spmd.get_logical_axis_rules()
  if mesh.empty or not rules:
    return x
  return jax.lax.with_sharding_constraint(x, spec(logical, rules, x.shape, mesh))


def jit_over_batch(fn, mesh, rules, param_shardings):
  """`fn(params, batch)` jitted: with a mesh, batches split over the `batch`
  rule, params placed by `param_shardings`, results replicated (evaluation)."""
  if mesh is None:
    return jax.jit(fn)
  return jax.jit(
    fn,
    in_shardings=(param_shardings, batch_sharding(mesh, rules)),
    out_shardings=replicated(mesh),
  )


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def global_from_full(batch: dict, sharding: NamedSharding) -> dict:
  """Global arrays from a batch every process holds whole (evaluation)."""
  return jax.tree.map(
    lambda x: jax.make_array_from_callback(
      x.shape, sharding, lambda index: np.asarray(x)[index]
    ),
    batch,
  )


def mesh_of(params) -> jax.sharding.Mesh | None:
  """The mesh `params` are placed on, or None (one device, uncommitted)."""
  placed = jax.tree.leaves(params)[0].sharding
  return placed.mesh if isinstance(placed, NamedSharding) else None


class Feed(NamedTuple):
  """How batches every process holds whole (evaluations, analyses) reach a
  model on `mesh`: split over the `batch` rule's axes, so each device reads
  its rows. `mesh` None: passed as they are (one device)."""

  mesh: jax.sharding.Mesh | None
  rules: tuple

  @classmethod
  def like(cls, params, rules) -> "Feed":
    """The feed of a model whose `params` are placed (`restore.Reader`)."""
    return cls(mesh_of(params), tuple(rules))

  def size(self, batch_size: int, rows: int | None = None) -> int:
    """A batch's rows: `eval_batch`'s."""
    return eval_batch(self.mesh, self.rules, batch_size, rows)

  def put(self, batch: dict) -> dict:
    if self.mesh is None:
      return batch
    return global_from_full(batch, batch_sharding(self.mesh, self.rules))


def host(tree):
  """`tree` on the host, whole, in every process: an array split over other
  processes' devices is gathered first (`jax.device_get` reads only this
  process's shards)."""

  def whole(x):
    split = isinstance(x, jax.Array) and not x.is_fully_addressable
    return multihost_utils.process_allgather(x, tiled=True) if split else x

  return jax.device_get(jax.tree.map(whole, tree))


class Placement(NamedTuple):
  """Where a run computes: its mesh, the logical-axis rules, and the group of
  each global batch's rows this process feeds (`process_rows`)."""

  mesh: jax.sharding.Mesh
  rules: tuple
  rows: tuple[int, int]


def run_mesh(config, devices=None) -> Placement:
  """This run's placement (`devices`: see `make_mesh`); the batch must split
  evenly over the mesh axes examples are split over."""
  mesh, rules = make_mesh(config.mesh, devices), tuple(config.sharding.rules)
  n, B = batch_split(mesh, rules), config.train.batch_size
  if B % n:
    raise ConfigError(
      f"train.batch_size: must be divisible by the {n} devices a batch is "
      f"split over (mesh axes of the rule for 'batch'); got {B}"
    )
  return Placement(mesh, rules, process_rows(mesh, rules, B))


def per_shard(fn, logical):
  """`fn` applied to each device's block of its arguments (`logical`: each
  argument's axis names; the result is split like the first), for kernels
  XLA's partitioner cannot split (Pallas calls: it would gather their
  operands whole). Without a mesh and rules, `fn` itself."""

  def run(*args):
    mesh, rules = jax.sharding.get_abstract_mesh(), spmd.get_logical_axis_rules()
    if mesh.empty or not rules:
      return fn(*args)
    specs = tuple(
      spec(n, rules, a.shape, mesh) for n, a in zip(logical, args, strict=True)
    )
    return jax.shard_map(
      fn, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False
    )(*args)

  return run
