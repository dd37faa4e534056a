"""`--mode=eval --follow`: an evaluation job that follows a training run.

On pods, training runs with in-loop evaluation off (`eval_every=0`) and a job
beside it (another host, another device) evaluates each checkpoint as it
appears: every probe split at every `eval.depths`, optionally the analyses.
It only reads the trainer's files (orbax renames a checkpoint into place when
it is complete, so a listed step is whole), never locks or writes what the
trainer writes, and remembers what it evaluated in `eval/metrics.jsonl`: each
checkpoint's record is appended once, after its `eval/step_<N>.json` is
written, so a restarted follower goes on where it stopped.
"""

import time

from loopjax import analyze, data, evaluate, metrics
from loopjax import config as config_lib
from loopjax.errors import first_line
from loopjax.workdir import Workdir


def follow(workdir, config=None, *, poll_s: float = 5.0, analyses: bool = False):
  """Evaluates every checkpoint of `workdir` once, until a checkpoint of the
  run's last step is evaluated. `config` (validated; the trainer's, as the
  launchers pass it) sets that step and what may differ from the run's config
  (eval.*, analyze.*); without it, the workdir's config.json does, read again
  at every look (a resumed run may train further). A follower started with a
  trainer that resumes a finished run to more steps needs the trainer's config:
  the old config.json says the run has finished."""
  wd, given = Workdir(workdir), config is not None
  config = _wait_for_config(wd, config, poll_s)
  _wait_for(lambda: wd.checkpoint_dir.is_dir(), f"{wd.checkpoint_dir}/", poll_s)
  task = data.load(config.data)
  reader = evaluate.Reader(config, wd.path, task)
  evaluator = evaluate.Evaluator(reader.graphdef, config, task, config.eval.depths)
  log = wd.path / "eval" / "metrics.jsonl"
  done = {r["step"] for r in metrics.read_jsonl(log)} if log.exists() else set()
  if done:
    print(f"follow: {len(done)} checkpoints already evaluated (newest {max(done)})")
  writer = metrics.Writer(log, wd.path / "tb" / "eval")
  try:
    while True:
      for step in [s for s in reader.steps() if s not in done]:
        if _evaluate(wd, config, task, reader, evaluator, writer, step, analyses):
          print(f"follow: evaluated step {step}")
        done.add(step)
      last = (config if given else wd.saved_config()).train.num_steps
      if any(s >= last for s in done):
        print(f"follow: the run has finished (step {last}); done")
        return
      time.sleep(poll_s)
  finally:
    writer.close()
    reader.close()


def _evaluate(wd, config, task, reader, evaluator, writer, step, analyses) -> bool:
  """Evaluates one checkpoint; False if it went away or does not restore."""
  try:
    model, _ = reader.model(step)
  except Exception as e:  # noqa: BLE001 - deleted by the trainer's keep policy, or damaged
    gone = not (wd.checkpoint_dir / str(step)).exists()
    print(
      f"follow: checkpoint {step} "
      + (
        "was deleted before it was evaluated; skipped"
        if gone
        else f"does not restore ({first_line(e)}); skipped"
      )
    )
    return False
  flat, per_depth = evaluator.run_all(model.params)
  evaluate.write_results(wd.path, evaluate.results(config, task, per_depth, step))
  if analyses:
    analyze.analyze(
      config, wd.path, step, out_dir=wd.path / "analysis" / f"step_{step}"
    )
  writer.write(step, flat)  # last: the record says the step is done
  return True


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
    print(f"follow: waiting for {what}")
  while not ready():
    time.sleep(poll_s)
