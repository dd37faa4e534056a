"""Every program a run compiles, lowered from abstract shapes and compiled
for a mesh (forced CPU devices or a target's compile-only chips): the train
step, evaluation at its deepest iteration count, a language model's
streamed analysis pass and sampling, a pretrained model's analysis and
forward. Each reports memory per device, compile time and XLA's warnings
(`python -m loopjax.aot` prints them, each pass's as its compile ends: on a
TPU target from a small host one can take minutes). A pass has a short name
(train, eval, analysis, sampling; a pretrained model's analysis and
forward) by which `only` chooses some. Before anything is lowered, a model
whose state cannot fit a device is refused (`_state_fits`)."""

import math
import os
import time

import jax
import numpy as np

from loopjax import compiled, footprint, restore, sharding, state, train
from loopjax import config as config_lib
from loopjax import task as task_lib
from loopjax.analysis import depth_scan, registry
from loopjax.bench import measure
from loopjax.errors import ConfigError, Stopped, first_line


def _batch(family, config, task, B: int, put) -> dict:
  """The family's batch of B rows as abstract arrays placed by `put`."""
  return {
    k: jax.ShapeDtypeStruct(shape, dtype, sharding=put)
    for k, (shape, dtype) in family.batch_shapes(config, task, B).items()
  }


class CompileFailed(Stopped):
  """The target's compiler failed on a program (its bug, not the config's)."""


def _compile(lowered, what: str, target: str, fields: str):
  """`lowered` compiled; a program the target's compiler finds too big for a
  chip (TPU's refuses at compile time) is a ConfigError naming the `fields`
  that size it, any other failure a CompileFailed naming the pass."""
  try:
    return lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" in str(e):
      raise ConfigError(
        f"{fields}: {what} does not fit "
        f"{target}: {first_line(e).removeprefix('RESOURCE_EXHAUSTED: ')}"
      ) from None
    raise CompileFailed(
      f"XLA failed to compile {what} for {target}: {first_line(e)}"
    ) from None


def _per_device(tree) -> int:
  """Bytes on each device of abstract arrays, each its shard as its sharding
  places it (PRNG keys, a few bytes, count nothing)."""
  return sum(
    math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    for x in jax.tree.leaves(tree)
    if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
  )


def _model_fields(config, vocab: int) -> str:
  """The fields that size a model's parameters (`footprint.params`): its
  width; its blocks' count and MLP, and the vocabulary, where they hold a
  quarter of the count or more; then the mesh axes that split them."""
  m = config.model
  total, embedding = footprint.params(m, vocab), vocab * m.d_model
  fields = ["model.d_model"]
  if 4 * (total - embedding) >= total:
    fields += [f"model.{k}" for k in ("num_prelude", "num_layers", "num_coda") if m[k]]
    fields.append("model.mlp_hidden" if m.mlp_hidden else "model.mlp_ratio")
  if 4 * embedding >= total:
    fields.append(
      "data.vocab_size" if vocab == config.data.vocab_size else "the vocabulary"
    )
  return ", ".join([*fields, "mesh.fsdp", "mesh.tensor"])


def _capacity(target, mesh) -> tuple[int, str]:
  """(bytes per device, what they are): a target's chip's, else this host's
  memory shared by its CPU devices (`footprint.capacity`)."""
  if target is None:
    return footprint.capacity(mesh)
  return target.bytes_per_device, f"a {target.name} device"


def _state_fits(fields: str, what: str, need: int, target, mesh) -> None:
  """Refuses (ConfigError naming `fields`) a state of `need` bytes per
  device more than a device holds: before anything is lowered, as a
  target's compiler may abort the process on a program that large (libtpu:
  a failed allocation in its own checks, nothing printed)."""
  cap, where = _capacity(target, mesh)
  if need > cap:
    raise ConfigError(
      f"{fields}: the model alone does not fit {where} ({what}: "
      f"{need / footprint.GIB:.2f} GiB per device as the mesh shards them; the "
      f"device has {cap / footprint.GIB:.2f} GiB)"
    )


def _bound_fits(config, family, task, train_step: bool, target, mesh) -> None:
  """Before the model is built (a block is a Python object: 2^31 of them
  never are): footprint's lower bound of the train step (as training holds
  it against the devices' memory), or for the other passes the float32
  params alone evenly split, against a device's memory (ConfigError naming
  the fields behind the bound's largest term)."""
  V = task.model_dims()[0]
  if train_step:
    terms = footprint.lower_bound(config, family, task, mesh)
  else:
    terms = {"the params": 4 * footprint.params(config.model, V) / mesh.devices.size}
  cap, where = _capacity(target, mesh)
  if (need := sum(terms.values())) <= cap:
    return
  big = max(terms, key=terms.get)
  fields = (
    _model_fields(config, V)
    if big in (footprint.STATE, "the params")
    else f"train.grokfast (kind, window), {_model_fields(config, V)}"
    if big.startswith(footprint.FILTER)
    else "model.num_loops (or train.depth.max), train.batch_size, data.seq_len"
    if big.startswith(footprint.ITERATIONS)
    else "train.batch_size, data.seq_len"
  )
  raise ConfigError(
    f"{fields}: {'a step' if train_step else 'the model'} needs at least "
    f"{need / footprint.GIB:,.1f} GiB per device ({big}: "
    f"{terms[big] / footprint.GIB:,.1f} GiB) and {where} has "
    f"{cap / footprint.GIB:.1f} GiB"
  )


def _train_state_fits(config, task, abstract, train_step: bool, target, mesh) -> None:
  """The run's state against a device's memory (`_state_fits`): the params,
  and for the train step its whole state (optimizer moments, gradient
  filters) and a gradient. On a target, the gradient's shard must also fit
  this host's memory: the target's compiler holds literals that size on the
  host while it compiles, and libtpu aborts when it cannot allocate one."""
  fields = _model_fields(config, task.model_dims()[0])
  grad = _per_device(abstract["params"])
  if not train_step:
    return _state_fits(fields, "the params", grad, target, mesh)
  need = _per_device(abstract) + grad
  _state_fits(fields, "params, optimizer state, a gradient", need, target, mesh)
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  if target is not None and grad > host:
    raise ConfigError(
      f"{fields}: compiling the train step for {target.name} holds its "
      f"gradient's shard ({grad / footprint.GIB:.2f} GiB per device) in this "
      f"host's {host / footprint.GIB:.2f} GiB: shard it more, or compile on a "
      "larger host"
    )


def _lower_and_compile(fn, args, what: str, target: str, fields: str) -> tuple:
  """`fn` lowered for `args` and compiled: (the executable, its memory and
  compile time, XLA's rematerialization warnings)."""
  t = time.perf_counter()
  with compiled.logged() as log:
    executable = _compile(fn.lower(*args), what, target, fields)
  mem = compiled.memory(executable) | {"compile_s": time.perf_counter() - t}
  return executable, mem, [x for x in log if compiled.REMAT in x]


def _compile_all(programs: dict, target: str, fields: str, on_pass) -> tuple:
  """Compiles each of `programs` ({pass: {name: (jitted fn, args)}}), calling
  `on_pass(name, memory and compile time)` as each one ends: ({name: memory
  and compile time}, XLA's rematerialization warnings)."""
  out, remat = {}, []
  for name, (fn, args) in (x for p in programs.values() for x in p.items()):
    _, out[name], log = _lower_and_compile(fn, args, f"the {name} pass", target, fields)
    on_pass(name, out[name])
    remat += log
  return out, remat


def _chosen(programs: dict, only) -> dict:
  """`programs` ({pass: ...}) narrowed to the passes named in `only` (all
  when empty); a name this run has no pass of is a ConfigError, raised
  before anything compiles."""
  if unknown := [p for p in only if p not in programs]:
    raise ConfigError(
      f"--passes: must be among this run's passes ({', '.join(programs)}); "
      f"got {','.join(unknown)!r}"
    )
  return {p: x for p, x in programs.items() if not only or p in only}


def _analysis(config, mesh, family, task, model) -> tuple:
  """The MECH analyses' streamed pass (`depth_scan`) to analyze.max_depth
  iterations over analyze.batch_size windows, on every device whole:
  (name, (jitted fn, args))."""
  a, rules, put = (
    config.analyze,
    tuple(config.sharding.rules),
    sharding.replicated(mesh),
  )
  B, T = a.batch_size, task.seq_len
  batch = _batch(family, config, task, B, put) | {
    "real": jax.ShapeDtypeStruct((B, T), bool, sharding=put)
  }

  def analysis(model, batch):
    with sharding.active(mesh, rules):
      key = jax.random.key(config.seed)  # a random first state (Huginn's)
      return depth_scan.run(model.module(), batch, a.max_depth, key)

  name = f"analysis, {a.max_depth} iterations, {B} x {T} tokens"
  return name, (jax.jit(analysis), (model, batch))


def check_pretrained(
  config, devices, target=None, only=(), on_pass=lambda name, mem: None
) -> dict:
  """A pretrained model's (`restore.abstract`: config.json is all it reads):
  lowers and compiles the MECH analyses' streamed pass to analyze.max_depth
  recurrences over analyze.batch_size prompts of data.seq_len tokens
  ("analysis"), and the forward at model.num_loops ("forward"), its params
  in model.dtype sharded by the rules; returns each one's memory, compile
  time and XLA's warnings. `only`, `on_pass`: as `check`'s."""
  rules = tuple(config.sharding.rules)
  mesh = sharding.make_mesh(config.mesh, devices)
  cfg, model, _ = restore.abstract(config, mesh)
  family = task_lib.for_config(config)
  task = family.without_examples(config)
  name, analysis = _analysis(config, mesh, family, task, model)
  tokens = analysis[1][1]["inputs"]

  def forward(model, tokens_BT):
    with sharding.active(mesh, rules):
      key = jax.random.key(config.seed)
      return model.module()(tokens_BT, None, num_loops=cfg.num_loops, key=key)

  programs = {
    "analysis": {name: analysis},
    "forward": {
      f"forward, {cfg.num_loops} iterations": (jax.jit(forward), (model, tokens))
    },
  }
  programs = _chosen(programs, only)
  fields = "model.hf_dir (its size), model.dtype, mesh.fsdp, mesh.tensor"
  _state_fits(fields, "the params", _per_device(model.params), target, mesh)
  where = target.name if target else f"cpu:{len(devices)}"
  passes, remat = _compile_all(
    programs,
    where,
    "analyze.batch_size, analyze.max_depth, data.seq_len, mesh",
    on_pass,
  )
  out = {
    "target": where,
    "capacity": target.bytes_per_device if target else None,
    "mesh": dict(mesh.shape),
    "batch": list(tokens.shape),
    "passes": passes,
    "rematerialized": remat,
  }
  params = jax.tree_util.tree_flatten_with_path(model.params)[0]
  out["params"] = sum(int(np.prod(x.shape)) for _, x in params)
  return out


def _other_passes(config, family, task, mesh, graphdef, abstract, shardings) -> dict:
  """A run's passes besides the train step, {pass: {name: (jitted fn,
  args)}}: evaluation ("eval") at its deepest iteration count over
  eval.batch_size rows (rounded up to the batch's split, as the evaluators
  do), the streamed analysis pass ("analysis") of a family whose analyses
  stream (where the run's analyses use it) and the family's sampling
  programs ("sampling"), where it has any."""
  rules = tuple(config.sharding.rules)
  B = sharding.eval_batch(mesh, rules, config.eval.batch_size)
  batch = _batch(family, config, task, B, sharding.batch_sharding(mesh, rules))
  step = family.eval_step(config, graphdef, mesh, shardings["params"])
  out = {"eval": {f"evaluation, {B} rows": (step, (abstract["params"], batch))}}
  model = state.Model(graphdef, abstract["params"], config.model.dtype)
  table = task_lib.spec(config.data.task).analyses
  if family.streams_analyses and registry.shared(table, config_lib.analyses(config)):
    name, analysis = _analysis(config, mesh, family, task, model)
    out["analysis"] = {name: analysis}
  if sampling := family.sampling_programs(config, task, model):
    out["sampling"] = sampling
  return out


def _bound(config, task, devices, target, executable) -> dict:
  """The train step's time per step bounded by the target chips' peak FLOP/s
  and HBM bandwidth, with the figures it comes from."""
  V, T = task.model_dims()
  flops = measure.model_flops(config, T, V) / len(devices)  # per device
  cost = executable.cost_analysis()  # None from XLA's GPU compiler
  cost = (cost[0] if isinstance(cost, list) else cost) or {}
  moved = float(cost.get("bytes accessed", 0.0))
  bound = {
    "compute_s": flops / target.peak_flops_per_device,
    "hbm_s": moved / target.hbm_bytes_per_s_per_device,  # 0: not reported
  }
  return {
    "model_flops_per_device": flops,
    "xla_bytes_accessed": moved,
    "step_s_bound": bound,
    "mfu_bound": bound["compute_s"] / max(bound.values()) if moved else None,
  }


def check(
  config, devices, target=None, only=(), on_pass=lambda name, mem: None
) -> dict:
  """Lowers and compiles the train step ("train") and the run's other passes
  (`_other_passes`) for a mesh over `devices`, or those of them named in
  `only`, calling `on_pass(name, memory and compile time)` as each compile
  ends; returns the report (`target`: the chips' figures, if they are a
  target's)."""
  family = task_lib.for_config(config)
  task = family.without_examples(config)
  mesh = sharding.run_mesh(config, devices).mesh
  _bound_fits(config, family, task, not only or "train" in only, target, mesh)
  graphdef, abstract, tx, shardings = state.sharded_train_state(
    config, task, mesh, abstract=True
  )
  step = train.make_train_step(config, graphdef, tx, mesh, shardings)
  B, put = config.train.batch_size, sharding.batch_sharding(mesh, config.sharding.rules)
  batch = _batch(family, config, task, B, put)
  programs = {"train": {"train step": (step, (abstract, batch))}}
  programs |= _other_passes(config, family, task, mesh, graphdef, abstract, shardings)
  programs = _chosen(programs, only)
  _train_state_fits(config, task, abstract, "train" in programs, target, mesh)
  report = {"target": target.name if target else f"cpu:{len(devices)}"}
  report["mesh"], remat = dict(mesh.shape), []
  if train_step := programs.pop("train", None):
    executable, mem, remat = _lower_and_compile(
      *train_step["train step"],
      "the train step",
      report["target"],
      "train.batch_size, data.seq_len, mesh, model.remat",
    )
    on_pass("train step", mem)
    report["compile_s"] = mem["compile_s"]
    report["memory"] = compiled.memory(executable)
    report["collectives"] = compiled.collectives(executable.as_text())
  params = jax.tree_util.tree_flatten_with_path(abstract["params"])[0]
  largest = sorted(params, key=lambda p: -int(np.prod(p[1].shape)))[:6]
  report["rematerialized"] = remat
  report["largest"] = [
    (jax.tree_util.keystr(path), x.shape, tuple(x.sharding.spec)) for path, x in largest
  ]
  report["passes"], remat = _compile_all(
    programs,
    report["target"],
    "eval.batch_size, analyze.batch_size, analyze.max_depth, data.seq_len, mesh",
    on_pass,
  )
  report["rematerialized"] += remat
  if target is None:
    return report
  report["capacity"] = target.bytes_per_device
  if train_step:
    report |= _bound(config, task, devices, target, executable)
  return report
