"""Entry point: parses flags and hands over to training or evaluation.

  python -m loopjax.main --config=experiments/sysgen.py[:variant] --workdir=DIR \
      [--config.model.num_loops=8 ...] [--mode=train|eval|analyze|report] [--step=N]
"""

import json
import os
import sys
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

from loopjax import config as config_lib

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
  "config", None, "Experiment config file[:variant].", lock_config=True
)
flags.DEFINE_string(
  "workdir", None, "Directory of the run (config, logs, checkpoints)."
)
flags.DEFINE_enum(
  "mode",
  "train",
  ["train", "eval", "analyze", "report"],
  "What to do with the workdir.",
)
flags.DEFINE_integer(
  "step", None, "--mode=eval/analyze: checkpoint step (default: newest)."
)
flags.DEFINE_bool(
  "distributed",
  False,
  "Join a multi-process run, letting JAX find the cluster (TPU VM slices, "
  "SLURM job steps); launch/tpu.py and launch/slurm.sbatch pass it.",
)
flags.DEFINE_string(
  "coordinator_address",
  None,
  "Multi-process runs elsewhere: host:port of process 0 (with --num_processes "
  "and --process_id; launch/local.py passes them).",
)
flags.DEFINE_integer("num_processes", None, "Multi-process runs: how many.")
flags.DEFINE_integer("process_id", None, "Multi-process runs: this one's index.")
flags.DEFINE_integer(
  "heartbeat_timeout", 60, "Seconds before a silent peer ends the whole run."
)


def _parse(argv):
  try:
    return FLAGS(argv)
  except (flags.Error, ValueError, KeyError, AttributeError) as e:
    lines = [x for x in str(e).splitlines() if x.strip()] or [repr(e)]
    config_lib.exit_with(
      lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
    )  # skip traceback


def _load_config(workdir: Path):
  if FLAGS.config is not None:
    return FLAGS.config
  if FLAGS.mode in ("eval", "analyze") and (workdir / "config.json").exists():
    # Over base(): fields added to loopjax after the run get their defaults.
    saved = json.loads((workdir / "config.json").read_text())
    c = config_lib.base()
    c.unlock()
    c.update(saved)  # recursive; JSON lists become the fields' tuples
    return c
  config_lib.exit_with(
    "--config is required (for --mode=eval or analyze, a workdir with config.json "
    "will do)"
  )


def main(argv):
  if len(argv) > 1:
    config_lib.exit_with(f"unexpected arguments: {' '.join(argv[1:])}")
  if not FLAGS.workdir:
    config_lib.exit_with("--workdir is required")
  workdir = Path(FLAGS.workdir).expanduser()
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  if FLAGS.mode == "report":  # reads metrics files only: no config needed
    from loopjax import report

    try:
      paths = report.report(workdir)
    except FileNotFoundError as e:
      config_lib.exit_with(str(e))
    print("wrote " + ", ".join(map(str, paths)))
    return
  config = _load_config(workdir)
  try:
    config_lib.validate(config)
  except config_lib.ConfigError as e:
    config_lib.exit_with(str(e))
  import jax  # after validation: a bad config fails fast

  from loopjax import analyze, evaluate, sharding, train

  try:
    sharding.initialize(
      FLAGS.distributed,
      FLAGS.coordinator_address,
      FLAGS.num_processes,
      FLAGS.process_id,
      FLAGS.heartbeat_timeout,
    )
  except config_lib.ConfigError as e:
    config_lib.exit_with(str(e))
  if FLAGS.mode != "train" and jax.process_count() > 1:
    config_lib.exit_with(
      f"--mode={FLAGS.mode} runs in one process; leave out the multi-process flags"
    )
  try:
    if FLAGS.mode == "train":
      train.train_and_evaluate(config, workdir)
      print(
        f"outputs in {workdir}: metrics.jsonl, phases.json, checkpoints/; plots: "
        f"--mode=report; TensorBoard: tensorboard --logdir {workdir / 'tb'}"
      )
    elif FLAGS.mode == "eval":
      train.check_workdir(config, workdir)
      evaluate.evaluate_checkpoint(config, workdir, FLAGS.step)
    else:
      train.check_workdir(config, workdir)
      paths = analyze.analyze(config, workdir, FLAGS.step)
      print("wrote " + ", ".join(map(str, paths)))
  except config_lib.ConfigError as e:
    config_lib.exit_with(str(e))
  except train.RunStopped as e:
    config_lib.exit_with(str(e), code=1)
  except jax.errors.JaxRuntimeError as e:
    if jax.process_count() == 1:
      raise
    # A peer died mid-collective (or its device failed). Leave now: JAX's exit
    # barrier would wait out the heartbeat timeout and then abort.
    print(
      f"error: process {jax.process_index()}: a cross-process operation failed "
      f"({config_lib.first_line(e)}); a peer process has probably died. Saved "
      "checkpoints are intact: rerun the same command on all hosts to resume",
      file=sys.stderr,
      flush=True,
    )
    sys.stdout.flush()
    os._exit(1)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse)
