"""Training: a pure, jitted train step over NNX state, and the loop around it.

The state is a plain pytree `{"params", "opt_state", "step", "rng"}`; the model's
graph definition is static. `train_step` is compiled once and donates its input
state; the loop dispatches step N before it reads step N-1's metrics, so the host
never waits on the device just to log.
"""

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.experimental import multihost_utils
from tqdm import tqdm

from loopjax import (
  checkpoint,
  curriculum,
  data,
  evaluate,
  metrics,
  recurrence,
  sharding,
)
from loopjax.analysis import grokking
from loopjax.config import ConfigError, conflicts, first_line, to_json
from loopjax.state import answer_loss, answer_xent, cast, sharded_train_state


def supervised(mode: str, R: int, hops_B, depth=None):
  """Which iterations' answers get a loss: bool (R, B), True where supervised;
  with a sampled `depth` (traced), iterations past it never are and the last
  is `depth`.

  "last": the answer after the final iteration only (the papers).
  "atomic_every": atomic facts (1 hop) after every iteration, the rest after
  the last: a fact must be retrievable at whatever iteration a composition
  needs it, not only at R (without it, OOD facts, never used as a first hop in
  training, resolve iterations later than ID ones; README, Results).
  "from_hops": every iteration from the example's hop count on (and the last).
  """
  t_R1, hops_1B = jnp.arange(1, R + 1)[:, None], hops_B[None]
  last = R if depth is None else depth
  if mode == "last":
    on_RB = jnp.broadcast_to(t_R1 == last, (R, hops_B.shape[0]))
  elif mode == "atomic_every":
    on_RB = (t_R1 == last) | (hops_1B == 1)
  else:
    on_RB = (t_R1 >= hops_1B) | (t_R1 == last)
  return on_RB & (t_R1 <= last)


def make_train_step(
  graphdef, tx, model_cfg, train_cfg, mesh=None, shardings=None, rules=()
):
  """The jitted step; `train_cfg.supervise` picks the supervised iterations.
  With a mesh: in/out shardings of the state (`shardings`) and the batch (split
  over the `batch` rule), metrics replicated, the recurrent state constrained."""
  label_smoothing = train_cfg.label_smoothing
  R, dd = model_cfg.num_loops, train_cfg.depth
  grad_depth = train_cfg.backprop_depth
  cur = train_cfg.curriculum

  def train_step(state, batch):
    with sharding.active(mesh, rules):
      return _step(state, batch)

  def _step(state, batch):
    key = jax.random.fold_in(state["rng"], state["step"])
    if dd.dist == "fixed":
      depth, loops = None, R
    else:  # scan to dd.max, mask past the sampled depth: one compiled program
      depth = recurrence.sample_depth(
        jax.random.fold_in(key, 1), dd.dist, dd.mean, dd.min, dd.max, dd.sigma
      )
      loops = dd.max

    def run(params, **kw):
      model = nnx.merge(graphdef, cast(params, model_cfg.dtype))
      return model(
        batch["inputs"],
        batch["answer_pos"],
        key=key,
        num_loops=loops,
        depth=depth,
        grad_depth=grad_depth,
        **kw,
      )

    def loss_fn(params):
      if train_cfg.supervise == "last":
        logits_BV = run(params)
        return answer_loss(logits_BV, batch["target"], label_smoothing)
      logits_BV, logits_RBV = run(params, per_iteration=True)
      # The answer sits after h r1..rk at position k: k hops.
      on_RB = supervised(train_cfg.supervise, loops, batch["answer_pos"], depth)
      loss_RB = answer_xent(logits_RBV, batch["target"][None], label_smoothing)
      loss = (loss_RB * on_RB).sum() / on_RB.sum()
      return loss, (logits_BV.argmax(-1) == batch["target"]).mean()

    (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    extra = {}
    if cur.enabled:  # the lr times lr_decay per stage passed
      scale = jnp.float32(cur.lr_decay) ** (state["stage"] - cur.start)
      updates = jax.tree.map(lambda u: u * scale, updates)
      extra["train/stage"] = state["stage"]
    if depth is not None:
      extra["train/depth"] = depth
    new_state = state | {
      "params": optax.apply_updates(state["params"], updates),
      "opt_state": opt_state,
      "step": state["step"] + 1,
    }
    return new_state, {
      "train/loss": loss,
      "train/acc": acc,
      "train/grad_norm": optax.tree.norm(grads),
    } | extra

  if mesh is None:
    return jax.jit(train_step, donate_argnums=0)
  return jax.jit(
    train_step,
    donate_argnums=0,
    in_shardings=(shardings, sharding.batch_sharding(mesh, rules)),
    out_shardings=(shardings, sharding.replicated(mesh)),
  )


def check_workdir(config, workdir: Path) -> None:
  """Raises ConfigError if the workdir holds a run with a conflicting config."""
  saved = workdir / "config.json"
  if saved.exists():
    diff = conflicts(json.loads(saved.read_text()), json.loads(to_json(config)))
    if diff:
      raise ConfigError(
        f"--workdir={workdir} holds a run with another config: "
        f"{'; '.join(diff)}. Use a new --workdir."
      )
  elif (workdir / "checkpoints").exists() and any((workdir / "checkpoints").iterdir()):
    raise ConfigError(
      f"--workdir={workdir} has checkpoints but no config.json; "
      "refusing to touch it. Use a new --workdir."
    )


def _check_writable(workdir: Path) -> None:
  """Fails now, not at the first checkpoint, if the workdir cannot be written."""
  probe = workdir / f".write-probe-{jax.process_index()}"
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b"")
    probe.unlink()
  except OSError as e:
    raise ConfigError(
      f"--workdir={workdir}: cannot write there ({e.strerror or e})"
    ) from e


def record_run(config, workdir: Path, task) -> None:
  """Writes config.json and dataset.json; refuses data that changed under a run."""
  sizes = {k: len(v["target"]) for k, v in task.splits.items()}
  dataset = {
    "fingerprint": data.fingerprint(task),
    "sizes": sizes,
    "vocab_size": task.vocab.vocab_size,
  }
  saved = workdir / "dataset.json"
  if (
    saved.exists()
    and json.loads(saved.read_text())["fingerprint"] != dataset["fingerprint"]
  ):
    raise ConfigError(
      f"--workdir={workdir} was trained on other data (fingerprint "
      f"in {saved} differs); use a new --workdir"
    )
  print(
    f"data: fingerprint {dataset['fingerprint'][:16]}, "
    + ", ".join(f"{k}={n}" for k, n in sizes.items())
  )
  if jax.process_index() == 0:  # whole files: other hosts may be reading them
    workdir.mkdir(parents=True, exist_ok=True)
    _write_atomic(workdir / "config.json", to_json(config))
    _write_atomic(saved, json.dumps(dataset, indent=2))


def _write_atomic(path: Path, text: str) -> None:
  tmp = path.with_name(f".{path.name}.tmp")
  tmp.write_text(text)
  os.replace(tmp, path)


class RunStopped(RuntimeError):
  """The run cannot go on (diverged, disk full); its saved checkpoints are intact."""


class _Preemption:
  """While active, SIGTERM/SIGINT set a flag the loop checks after each step.

  With several processes, all must stop after the same step (a save is
  collective): JAX's preemption service hears SIGTERM and
  `reached_preemption_sync_point` tells every process the same step, so the
  handlers stay JAX's.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __enter__(self):
    self.signal, self._old = None, None
    if jax.process_count() == 1:
      self._old = [signal.signal(s, self._handle) for s in self.SIGNALS]
    return self

  def __exit__(self, *exc):
    if self._old is not None:
      for s, old in zip(self.SIGNALS, self._old, strict=True):
        signal.signal(s, old)

  def _handle(self, signum, frame):
    self.signal = signal.Signals(signum).name

  def requested(self, step: int) -> bool:
    if self._old is None and multihost_utils.reached_preemption_sync_point(step):
      self.signal = "SIGTERM (all processes)"
    return self.signal is not None


def train_and_evaluate(config, workdir) -> dict:
  """Trains (resuming from the workdir's newest checkpoint); returns last metrics."""
  workdir = Path(workdir)
  check_workdir(config, workdir)
  task = data.load(config.data)  # bad data settings fail before the workdir exists
  curriculum.check_task(config, task)
  placement = sharding.run_mesh(config)  # mesh and batch errors before workdir writes
  _check_writable(workdir)
  with _exclusive(workdir):
    return _train(config, workdir, task, placement)


@contextlib.contextmanager
def _exclusive(workdir: Path):
  """One trainer per workdir: a second would interleave checkpoints and logs.
  The OS drops the lock when the process ends, however it ends."""
  with open(workdir / f".train-{jax.process_index()}.lock", "a+") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      f.seek(0)
      raise ConfigError(
        f"--workdir={workdir}: another process (pid {f.read().strip() or '?'}) "
        "is training there; wait for it to end or use a new --workdir"
      ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    yield


def _train(config, workdir: Path, task, placement) -> dict:
  """`placement`: sharding.run_mesh's (mesh, rules, rows), computed before the lock."""
  record_run(config, workdir, task)
  mesh, rules, rows = placement
  batch_sharding = sharding.batch_sharding(mesh, rules)
  graphdef, state, tx, shardings = sharded_train_state(config, task, mesh)
  train_step = make_train_step(
    graphdef, tx, config.model, config.train, mesh, shardings, rules
  )
  evaluator = evaluate.Evaluator(
    graphdef, config, task, mesh=mesh, param_shardings=shardings["params"]
  )
  B = config.train.batch_size
  train_iter = curriculum.train_iterator(config, task, rows)

  phases = grokking.load(workdir)  # the loop adds each phase's step: kept forever
  mngr = checkpoint.manager(workdir, config.checkpoint, pinned=phases)
  restored, start = checkpoint.restore(mngr, checkpoint.abstract(state), train_iter)
  if restored is not None:
    state = restored
    if "stage" in state and int(state["stage"]) != train_iter.stage:
      raise ConfigError(  # saved together: only a hand-edited checkpoint differs
        f"checkpoint {start}: curriculum stage {int(state['stage'])} in the state "
        f"but {train_iter.stage} in the data iterator"
      )
    print(f"resumed from {workdir / 'checkpoints'} at step {start}")
  start = start or 0
  if start >= config.train.num_steps:
    print(f"already trained to step {start}; nothing to do")
    mngr.close()
    return {}
  writer = metrics.Writer(workdir)
  failure = None
  try:
    writer.start(start)
    with _Preemption() as preempt:
      run = _Run(
        config,
        workdir,
        lambda state, batch: train_step(
          state, sharding.global_batch(batch, batch_sharding, B)
        ),
        tx,
        train_iter,
        evaluator,
        mngr,
        writer,
        preempt,
        phases,
      )
      step, last = _loop(run, state, start)
  except (FloatingPointError, OSError) as e:
    failure = e
  finally:  # an error mid-run still completes pending saves and flushes logs
    try:
      checkpoint.wait(mngr)
    except checkpoint.WriteError as e:
      failure = failure or e
    mngr.close()
    writer.close()
  if failure is not None:
    mngr.reload()  # what is on disk, not orbax's in-memory list
    newest = mngr.latest_step()
    raise RunStopped(
      f"{first_line(failure)}; the run stopped. "
      + (
        f"Checkpoints are intact, newest: step {newest} in {workdir / 'checkpoints'}"
        if newest is not None
        else "No checkpoint was saved."
      )
    ) from failure
  print(
    f"phases: {grokking.summary(phases)}"
    if config.data.task == "composition"
    else f"curriculum: {curriculum.stages_summary(phases, config)}"
  )
  if preempt.signal is not None:
    print(
      f"{preempt.signal}: saved step {step} to {workdir / 'checkpoints'}; "
      "rerun the same command to resume"
    )
  return last


@dataclasses.dataclass
class _Run:
  """What the loop works with, besides the state it steps."""

  config: object
  workdir: Path
  train_step: object
  tx: object  # the optimizer, for a fresh state per curriculum stage
  train_iter: object
  evaluator: evaluate.Evaluator
  mngr: object
  writer: metrics.Writer
  preempt: _Preemption
  phases: dict  # phase -> step; its steps' checkpoints are kept (see checkpoint.py)


def _loop(run: _Run, state, start: int):
  """Steps until num_steps or a signal; logs, evaluates and saves on cadence."""
  config, mngr, writer, phases = run.config, run.mngr, run.writer, run.phases
  train_iter, preempt = run.train_iter, run.preempt
  num_steps = config.train.num_steps
  with tqdm(
    total=num_steps,
    initial=start,
    desc="train",
    unit="step",
    disable=jax.process_index() != 0,
    dynamic_ncols=True,
  ) as bar:
    last, pending, step, saved = {}, None, start, start
    t_log, step_log = time.perf_counter(), start
    while step < num_steps and not preempt.requested(step):
      state, step_metrics = run.train_step(state, next(train_iter))
      step += 1
      if pending is not None:  # step - 1's numbers: ready by now, no stall
        last |= _check_finite(*pending)
      pending = (step, step_metrics)
      done, new = step == num_steps, []
      if step % config.log_every == 0 or done:
        last |= _check_finite(*pending)
        pending = None
        rate = (step - step_log) / (time.perf_counter() - t_log)
        t_log, step_log = time.perf_counter(), step
        writer.write(
          step, {k: last[k] for k in step_metrics} | {"train/steps_per_s": rate}
        )
      if step % config.eval_every == 0 or done:
        ev = run.evaluator.run(state["params"])  # replaces every older eval value:
        last = {k: v for k, v in last.items() if not k.startswith("eval/")} | ev
        writer.write(step, ev)  # a metric this eval lacks must not be logged stale
        new = grokking.newly_reached(last, config.phases, phases)
        phases.update(dict.fromkeys(new, step))
        # On the cadence only: where a run stops must not change its course.
        advanced = False
        if step % config.eval_every == 0:
          state, advanced = curriculum.advance(run, state, step, last)
        if advanced:
          new.append(f"curriculum stage {run.train_iter.stage}")
        if new:
          if jax.process_index() == 0:
            grokking.save(run.workdir, phases)
          bar.write(f"step {step}: reached {', '.join(new)}")
      if step % config.checkpoint.every == 0 or done or new:
        if pending is not None:  # never save past a step whose numbers are bad
          last |= _check_finite(*pending)
          pending = None
        checkpoint.save(mngr, step, state, train_iter)
        saved = step
      bar.update(1)
      bar.set_postfix(_postfix(last), refresh=False)
    if preempt.signal is not None and saved != step:
      checkpoint.save(mngr, step, state, train_iter)
    return step, last


def _check_finite(step: int, step_metrics) -> dict:
  out = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
  bad = {k: v for k, v in out.items() if not math.isfinite(v)}
  if bad:
    raise FloatingPointError(
      f"step {step}: " + ", ".join(f"{k} is {v}" for k, v in bad.items())
    )
  return out


def _postfix(last: dict) -> dict:
  short = {"loss": last.get("train/loss")}
  for k, v in last.items():
    if k.startswith("eval/") and k.endswith("/acc"):
      short[k[5:-4]] = v
  return {k: f"{v:.3f}" for k, v in short.items() if v is not None}
