"""Training: a pure, jitted train step over NNX state, and the loop around it.

The state is a plain pytree `{"params", "opt_state", "step", "rng"}` (plus
`"stage"` for a curriculum, and the entries of `state.OPTIONAL` a config asks
for: the params' EMA, the step the stage began); the model's graph
definition is static.
`train_step` is compiled ahead of time, once per batch shape, and its compiled
memory held against the devices' before it runs (`_Compiled`); it donates its
input state, and the loop dispatches
step N before it reads step N-1's metrics, so the host never waits on the
device just to log. The run directory's records and rules are workdir.py's;
the loop applies what phase detection and the curriculum decide.
"""

import dataclasses
import math
import time

import jax
import optax

from loopjax import (
  checkpoint,
  compiled,
  ema,
  footprint,
  metrics,
  preemption,
  recurrence,
  sharding,
)
from loopjax import task as task_lib
from loopjax.errors import ConfigError, Stopped, first_line
from loopjax.fork import Fork
from loopjax.lease import LeaseLost
from loopjax.pretrained import init_from
from loopjax.state import Model, sharded_train_state, with_optional
from loopjax.workdir import Workdir


def make_train_step(config, graphdef, tx, mesh=None, shardings=None):
  """The jitted step (state, batch) -> (state, metrics). With a mesh: the
  state's `shardings`, batches split over the `batch` rule, metrics replicated,
  the recurrent state constrained in every iteration."""
  m, t = config.model, config.train
  rules, dd = tuple(config.sharding.rules), t.depth
  family = task_lib.for_config(config)

  def train_step(state, batch):
    with sharding.active(mesh, rules):
      key = jax.random.fold_in(state["rng"], state["step"])
      if dd.dist == "fixed":
        depth, loops = None, m.num_loops
      else:  # scan to dd.max, mask past the sampled depth: one compiled program
        depth = recurrence.sample_depth(
          jax.random.fold_in(key, 1), dd.dist, dd.mean, dd.min, dd.max, dd.sigma
        )
        loops = dd.max

      def objective(params):
        model = Model(graphdef, params, m.dtype).module()
        return family.loss_fn(model, batch, t, key=key, num_loops=loops, depth=depth)

      (value, acc), grads = jax.value_and_grad(objective, has_aux=True)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    extra = {"train/stage": state["stage"]} if "stage" in state else {}
    if depth is not None:
      extra["train/depth"] = depth
    if (scale := family.update_scale(config, state)) is not None:
      updates = jax.tree.map(lambda u: scale * u, updates)
      extra["train/last_stage_scale"] = scale
    params = optax.apply_updates(state["params"], updates)
    new_state = state | {
      "params": params,
      "opt_state": opt_state,
      "step": state["step"] + 1,
    }
    if "ema" in state:
      new_state["ema"] = ema.update(state["ema"], params, t.param_ema, state["step"])
    return new_state, {
      "train/loss": value,
      "train/acc": acc,
      "train/grad_norm": optax.tree.norm(grads),
    } | extra

  placed = {}
  if mesh is not None:
    placed = dict(
      in_shardings=(shardings, sharding.batch_sharding(mesh, rules)),
      out_shardings=(shardings, sharding.replicated(mesh)),
    )
  return jax.jit(train_step, donate_argnums=0, **placed)


class _Compiled:
  """The train step as the executables it compiles ahead of time, one per
  batch shape (a curriculum stage may change it), each checked before it first
  runs: its compiled peak against the devices' memory (`footprint`). Running
  the executable itself, not the jitted function, is what keeps the check from
  costing a second compile.

  `compile/*` (time and peak) is logged once per compile: when this process
  compiled the program, or when a fresh run (from step 0) loaded one another
  run compiled into the persistent cache. A resume that loads it logs only
  the load's time, `cache/train_step_load_s`: its peak is in the records."""

  def __init__(self, jitted, config, mesh, writer):
    self.jitted, self.config, self.mesh, self.writer = jitted, config, mesh, writer
    self._by_shape, self._resumed = {}, None  # _resumed: at the first compile

  def __call__(self, state, batch):
    key = tuple((x.shape, x.dtype) for x in jax.tree.leaves(batch))
    if (run := self._by_shape.get(key)) is None:
      run = self._by_shape[key] = self._compile(state, batch)
    return run(state, batch)

  def _compile(self, state, batch):
    start = time.perf_counter()
    lowered = self.jitted.lower(state, batch)
    executable, loaded = compiled.compile_or_load(lowered)
    seconds = time.perf_counter() - start
    memory = compiled.memory(executable)
    footprint.check_compiled(self.config, memory, self.mesh)
    step = int(state["step"])
    self._resumed = step > 0 if self._resumed is None else self._resumed
    gib = {f"compile/train_step_{k}_gib": v / footprint.GIB for k, v in memory.items()}
    if loaded:  # the time is a read's; the peak is logged where it was compiled
      self.writer.write(step, {"cache/train_step_load_s": seconds})
      gib = {} if self._resumed else gib  # a fresh run on another's program: once
    else:
      gib["compile/train_step_s"] = seconds
    if gib:
      self.writer.write(step, gib)
    return executable


class RunStopped(Stopped):
  """The run cannot go on (diverged, disk full); its saved checkpoints are intact."""


def train_and_evaluate(config, workdir) -> dict:
  """Trains (resuming from the workdir's newest checkpoint); returns last metrics."""
  config = init_from.resolve(config)  # a pretrained model's shapes, recorded as such
  family = task_lib.for_config(config)
  wd = Workdir(workdir)
  wd.check(config)
  # a fork's source, unreadable or not a run, fails before any data is built
  named = None if wd.has_committed() else Fork.source_of(config)
  task = family.load(config)  # bad data settings fail before the workdir exists
  dataset = task.summary()  # fingerprints every array: once
  mesh, rules, rows = sharding.run_mesh(config)  # mesh errors before any write
  footprint.check(config, family, task, mesh)  # in seconds, before the model
  graphdef, abstract, tx, shardings = sharded_train_state(
    config, task, mesh, abstract=True
  )
  wd.check_data(dataset)
  fork = Fork.of(config, named, dataset) if named else None
  wd.check_writable()
  with wd.exclusive("train", config.checkpoint.lease_s):
    reached = fork.phases() if fork else {}  # a fork's: the source's, up to it
    try:
      wd.record(config, task, family.phase_names(config), dataset, reached)
    except OSError as e:  # a full disk before the first step: no checkpoint yet
      raise RunStopped(
        f"writing in {wd.path}: {first_line(e, 200)}; the run stopped before "
        "its first step"
      ) from e
    mngr = wd.checkpoints(config.checkpoint)
    train_iter = family.train_iterator(config, task, rows)
    if fork is None and not mngr.all_steps():  # fresh: model.init_from's params
      m = config.model  # if given (a resumed run never reads them)
      params = init_from.params(config, mesh) if m.init_from else None
      state, start = sharded_train_state(config, task, mesh, params=params)[1], 0
      if m.init_from:
        print(f"started from {m.init_from} (prelude, core, coda: {m.hf_split})")
    else:  # its own newest good checkpoint, or the one it forks
      state, start = (
        _restore_fork(config, fork, abstract, train_iter)
        if fork
        else checkpoint.restore(mngr, abstract, train_iter)
      )
      if "stage" in state and int(state["stage"]) != train_iter.stage:
        raise ConfigError(  # saved together: only a hand-edited checkpoint differs
          f"checkpoint {start}: curriculum stage {int(state['stage'])} in the "
          f"state but {train_iter.stage} in the data iterator"
        )
      came = fork.source.path if fork else wd.checkpoint_dir
      print(f"{'forked' if fork else 'resumed'} from {came} at step {start}")
    if start >= config.train.num_steps:
      print(f"already trained to step {start}; nothing to do")
      mngr.close()
      return {}
    loop = _Loop(
      config=config,
      family=family,
      wd=wd,
      graphdef=graphdef,
      mesh=mesh,
      shardings=shardings,
      tx=tx,
      train_iter=train_iter,
      evaluator=family.evaluator(
        config, task, graphdef, mesh=mesh, shardings=shardings["params"]
      ),
      mngr=mngr,
      writer=metrics.Writer(wd.path, wd.path / "tb", lost=wd.lost),
      step=start,
    )
    return loop.run_to_end(state)


def _restore_fork(config, fork, abstract, train_iter):
  """(state, step) of the fork's source checkpoint, restored as its own
  config laid it out; then `config`'s optional entries (state.OPTIONAL) begun
  or dropped: a fork may turn the params' EMA or the last stage's decay on
  (each starts at the fork) or off."""
  source = fork.source.saved_config()
  state, step = fork.restore(
    config.checkpoint, with_optional(source, abstract), train_iter
  )
  return with_optional(config, state), step


def _clean_up(failure, *steps):
  """Runs every clean-up step whatever the others do; returns the run's
  failure: the one that stopped it, else the first write error in clean-up (on
  a full disk every step fails; the first error is the one worth a line)."""
  for step in steps:
    try:
      step()
    except (OSError, checkpoint.WriteError) as e:
      failure = failure or e
  return failure


@dataclasses.dataclass
class _Loop:
  """Steps until num_steps or a signal; logs, evaluates and saves on cadence."""

  config: object
  family: task_lib.Family
  wd: Workdir
  graphdef: object  # with mesh, shardings and tx: what the step is built from
  mesh: object
  shardings: dict
  tx: object  # the optimizer, also for a fresh state per curriculum stage
  train_iter: object
  evaluator: object  # the family's: run(params) -> metrics
  mngr: object
  writer: metrics.Writer
  step: int  # the state's step: where a stopped run stopped

  def run_to_end(self, state) -> dict:
    """Runs, then completes pending saves and flushes logs whatever happened;
    raises RunStopped (checkpoints intact) on a diverged or unwritable run."""
    failure, reason, mngr, wd = None, "stopped", self.mngr, self.wd
    lost = None
    try:
      self.writer.start(self.step)
      with preemption.Preemption() as preempt:
        step, last = self.run(state, preempt)
      reason = "finished" if preempt.signal is None else "preempted"
    except (FloatingPointError, OSError) as e:
      failure = e
    except LeaseLost as e:  # another trainer owns the workdir now: no records
      lost = e
    finally:  # an error mid-run still completes pending saves and flushes logs
      try:
        checkpoint.wait(mngr)  # a save begun before the lease was lost ends
      except checkpoint.WriteError as e:
        failure, reason = failure or e, "stopped"
      end = lambda: self.writer.end(self.step, reason)  # an evaluation job stops
      failure = _clean_up(failure, mngr.close, end, self.writer.close)
    if lost is not None:
      raise RunStopped(
        f"{lost}; stopped without saving more (a save under way when it was "
        "taken finished)"
      ) from lost
    if failure is not None:
      mngr.reload()  # what is on disk, not orbax's in-memory list
      newest = max(checkpoint.steps(mngr), default=None)
      where = f"writing in {wd.path}: " if isinstance(failure, OSError) else ""
      raise RunStopped(
        f"{where}{first_line(failure, 200)}; the run stopped. "
        + (
          f"Checkpoints are intact, newest: step {newest} in {wd.checkpoint_dir}"
          if newest is not None
          else "No checkpoint was saved."
        )
      ) from failure
    if (line := self.family.finished(self.config, wd.phases)) is not None:
      print(line)
    if preempt.signal is not None:
      print(
        f"{preempt.signal}: saved step {step} to {wd.checkpoint_dir}; "
        "rerun the same command to resume"
      )
    return last

  def run(self, state, preempt):
    config = self.config
    num_steps, eval_every = config.train.num_steps, config.eval_every
    progress = metrics.Progress(num_steps, self.step)
    last, pending, step, saved = {}, None, self.step, self.step
    train_step = _Compiled(
      make_train_step(config, self.graphdef, self.tx, self.mesh, self.shardings),
      config,
      self.mesh,
      self.writer,
    )
    batches = sharding.batch_sharding(self.mesh, config.sharding.rules)
    try:
      while step < num_steps and not preempt.requested(step):
        batch = sharding.global_batch(
          next(self.train_iter), batches, config.train.batch_size
        )
        state, step_metrics = train_step(state, batch)
        preempt.arm()  # compiled: from now on a signal saves the step it stops at
        step = self.step = step + 1
        if pending is not None:  # step - 1's numbers: ready by now, no stall
          last |= _check_finite(*pending)
        pending = (step, step_metrics)
        done, reached = step == num_steps, []
        if step % config.log_every == 0 or done:
          last |= _check_finite(*pending)
          pending = None
          self.writer.write(
            step, {k: last[k] for k in step_metrics} | progress.rate(step)
          )
        if eval_every and (step % eval_every == 0 or done):
          state, last, reached = self._evaluate(state, step, last)
          if reached:
            names = [n.replace("stage_", "curriculum stage ") for n in reached]
            progress.write(f"step {step}: reached {', '.join(names)}")
        if step % config.checkpoint.every == 0 or done or reached:
          if pending is not None:  # never save past a step whose numbers are bad
            last |= _check_finite(*pending)
            pending = None
          self._save(step, state)
          saved = step
        progress.update(step, last)
      if preempt.signal is not None and saved != step:
        self._save(step, state)
    finally:
      progress.close()
    return step, last

  def _save(self, step: int, state) -> None:
    """The step's records first (a resume from it repeats none of them),
    then the checkpoint, if this job still holds the workdir."""
    self.wd.fence()
    self.writer.flush()
    checkpoint.save(self.mngr, step, state, self.train_iter)

  def _evaluate(self, state, step: int, last: dict):
    """Evaluates, then applies what the family decides (grokking phases, a
    curriculum stage): (state, metrics, names of the phases reached here)."""
    ev = self.evaluator.run(state["params"])  # replaces every older eval value:
    if "ema" in state:  # the average beside the raw params, as ema/...
      ev |= ema.renamed(self.evaluator.run(state["ema"]))
    old = lambda k: k.startswith("eval/") or ema.is_metric(k)  # noqa: E731
    last = {k: v for k, v in last.items() if not old(k)} | ev
    self.writer.write(step, ev)  # a metric this eval lacks must not be logged stale
    state, reached = self.family.after_eval(
      self.config, step, last, self.wd.phases, self.train_iter, state, self.tx
    )
    if reached:
      self.wd.reach(reached, step)
    return state, last, reached


def _check_finite(step: int, step_metrics) -> dict:
  out = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
  bad = {k: v for k, v in out.items() if not math.isfinite(v)}
  if bad:
    raise FloatingPointError(
      f"step {step}: " + ", ".join(f"{k} is {v}" for k, v in bad.items())
    )
  return out
