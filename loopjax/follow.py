"""`--mode=eval --follow`: an evaluation job that follows a training run.

On pods, training runs with in-loop evaluation off (`eval_every=0`) and a job
beside it (another host, another device) evaluates each checkpoint as it
appears: every probe split at every `eval.depths`, optionally the analyses.
It only reads the trainer's files (orbax lists a step once it is committed,
so a listed step is whole) and writes under `eval/` (and
`analysis/step_<N>/`), one follower per workdir. `eval/metrics/` is its
record: a checkpoint's record is written once, after its `eval/step_<N>.json`
and TensorBoard points (tags `eval_job/...`), so a restarted follower goes on
where it stopped. It reads the trainer's records at every look, each chunk
once (`metrics.Log`). For composition runs it also writes
`eval/phases.json`, the grokking phases its evaluations show.

It ends once a checkpoint of the run's last step is evaluated, or, if the
trainer stops early (an error, a preemption: its `end` record, newer than
the follower), once what it saved is evaluated
(exit 1). A trainer killed outright writes no `end`: the follower then waits.
"""

import json
import time

from loopjax import checkpoint, ema, evaluate, metrics, restore, storage
from loopjax import config as config_lib
from loopjax import task as task_lib
from loopjax.errors import Stopped
from loopjax.workdir import Workdir

RETRIES = 3  # looks at a checkpoint that does not restore before skipping it


class TrainerStopped(Stopped):
  """The trainer ended before its last step; everything it saved is evaluated."""


def follow(workdir, config=None, *, poll_s: float = 2.0, analyses: bool = False):
  """Evaluates every checkpoint of `workdir` once, until a checkpoint of the
  run's last step is evaluated. `config` (validated; the trainer's, as the
  launchers pass it) sets that step and what may differ from the run's config
  (eval.*, analyze.*); without it, the workdir's config.json does, read again
  at every look. A follower started with a trainer that resumes a finished run
  to more steps needs the trainer's config: the old config.json says the run
  has finished."""
  wd, given, started = Workdir(workdir), config is not None, time.time()
  config = _wait_for_config(wd, config, poll_s)
  _wait_for(lambda: wd.checkpoint_dir.is_dir(), f"{wd.checkpoint_dir}/", poll_s)
  wd.check_writable("eval")
  with wd.exclusive("follow", config.checkpoint.lease_s):
    task = task_lib.for_config(config).load(config)
    reader = restore.Reader(config, wd.path, task, ema=True)  # and the params' EMA
    job, trainer = _Job(wd, config, task, reader, analyses), metrics.Log(wd.path)
    if job.done:
      print(
        f"follow: {len(job.done)} checkpoints already evaluated (newest "
        f"{max(job.done)})"
      )
    try:
      while True:
        for step in [s for s in reader.steps() if s not in job.done]:
          job.evaluate(step)
        last = (config if given else wd.saved_config()).train.num_steps
        if final := [s for s in job.done if s >= last]:
          if final[0] in job.damaged:
            raise TrainerStopped(
              f"follow: the run has finished but its final checkpoint {final[0]} "
              "does not restore"
            )
          print(f"follow: the run has finished (step {last}); done")
          return
        end = _trainer_end(trainer, since=started)
        if end is not None and not [s for s in reader.steps() if s not in job.done]:
          raise TrainerStopped(
            f"follow: the trainer stopped at step {end['step']} ({end['reason']}), "
            f"before step {last}; every checkpoint it saved is evaluated. Start "
            "the follower again with the resumed trainer"
          )
        time.sleep(poll_s)
    finally:
      job.close()


class _Job:
  """The follower's state: what it evaluated, and where it writes."""

  def __init__(self, wd: Workdir, config, task, reader, analyses: bool):
    self.wd, self.config, self.data, self.reader = wd, config, task, reader
    self.analyses, self.family = analyses, task_lib.for_config(config)
    self.evaluator = self.family.evaluator(
      config, task, reader.graphdef, config.eval.depths
    )
    self.records = metrics.read(wd.path / "eval")
    self.done = {r["step"] for r in self.records}
    self.failures: dict[int, int] = {}
    self.damaged: set[int] = set()
    self.writer = metrics.Writer(  # its own TensorBoard folder: its files
      wd.path / "eval",  # would interleave with the trainer's by name
      wd.path / "tb" / "eval_job",
      tb_section="eval_job",
      flush_s=0,
      lost=wd.lost,
    )

  def evaluate(self, step: int) -> None:
    """Evaluates one checkpoint, or says in one line why it could not (deleted
    by the trainer's keep policy before or while it was read; damaged: after
    RETRIES looks). What the libraries log about a read that failed goes to
    their log, not the terminal (`liblog`, set up by `cli.ended`). Its
    records are this job's alone: the lease is checked first."""
    self.wd.fence()
    try:
      models, _ = self.reader.models(step)
      model = models["params"]
      flat, per_depth = self.evaluator.run_all(model.params)
      averaged = None
      if "ema" in models:  # the params' EMA beside them, as ema/...
        ema_flat, averaged = self.evaluator.run_all(models["ema"].params)
        flat |= ema.renamed(ema_flat)
      report = evaluate.results(self.config, self.data, per_depth, step, averaged)
      evaluate.write_results(self.wd.path, report)
      if self.analyses:
        out = self.wd.path / "analysis" / f"step_{step}"
        self.family.analyze(
          self.config, self.wd.path, self.data, model, step, out, False
        )
    except Exception as e:  # noqa: BLE001 - a checkpoint gone or unreadable
      if not (self.wd.checkpoint_dir / str(step)).exists():
        print(f"follow: checkpoint {step} was deleted before it was evaluated; skipped")
        self.done.add(step)
        return
      self.failures[step] = self.failures.get(step, 0) + 1
      if self.failures[step] < RETRIES:
        return
      why = checkpoint.damage(e)  # without TensorStore's spec dump
      print(f"follow: checkpoint {step} does not restore ({why}); skipped")
      self.done.add(step)
      self.damaged.add(step)
      return
    self.writer.write(step, flat)  # last: the record says the step is done
    self.records.append({"step": step, **flat})
    self.done.add(step)
    if (phases := self.family.follow_phases(self.config, self.records)) is not None:
      storage.write_whole(
        self.wd.path / "eval" / "phases.json", json.dumps(phases, indent=2)
      )
    print(f"follow: evaluated step {step}")

  def close(self) -> None:
    self.writer.close()
    self.reader.close()


def _trainer_end(trainer: metrics.Log, since: float) -> dict | None:
  """The trainer's newest `end` record if it came after `since` and after its
  newest `start` (an early stop this follower saw happen), else None."""
  events = [r for r in trainer.read() if "event" in r]
  last = events[-1] if events else None
  if last and last["event"] == "end" and last["time"] > since:
    return None if last["reason"] == "finished" else last
  return None


def _wait_for_config(wd: Workdir, config, poll_s: float):
  """The run's config once its config.json exists; a given `config` must not
  conflict with it."""
  _wait_for(lambda: (wd.path / "config.json").exists(), wd.path / "config.json", poll_s)
  if config is not None:
    wd.check(config)
    return config
  config = wd.saved_config()
  config_lib.validate(config)
  return config


def _wait_for(ready, what, poll_s: float) -> None:
  if not ready():
    print(f"follow: waiting for {what}", flush=True)  # a pipe would hold it
  while not ready():
    time.sleep(poll_s)
