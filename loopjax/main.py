"""Entry point: parses flags and hands over to training or evaluation.

  python -m loopjax.main --config=experiments/sysgen.py[:variant] --workdir=DIR \
      [--config.model.num_loops=8 ...] [--mode=train|eval|analyze|report] [--step=N]
  python -m loopjax.main --mode=eval --follow --workdir=DIR   # beside a trainer
  python -m loopjax.main --mode=sample --workdir=DIR --prompt="def "  # LM runs
  python -m loopjax.main --mode=lm_eval --workdir=DIR --tasks=arc_easy \
      [--recurrences=4,8,16,32]  # an LM run or model.hf_dir, lm-evaluation-harness
"""

import os
import sys
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

from loopjax import config as config_lib
from loopjax import xla
from loopjax.errors import ConfigError, exit_with, first_line
from loopjax.workdir import Workdir

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
  ["train", "eval", "analyze", "report", "sample", "lm_eval"],
  "What to do with the workdir.",
)
flags.DEFINE_integer(
  "step", None, "--mode=eval/analyze: checkpoint step (default: newest)."
)
flags.DEFINE_bool(
  "follow",
  False,
  "--mode=eval: evaluate each new checkpoint of the workdir as it appears, "
  "until the training run has finished (an evaluation job beside a trainer).",
)
flags.DEFINE_bool(
  "analyze", False, "--mode=eval --follow: also run analyze.names on each checkpoint."
)
flags.DEFINE_float("poll_s", 2.0, "--follow: seconds between looks for checkpoints.")
flags.DEFINE_string("prompt", "", "--mode=sample: the text to continue.")
flags.DEFINE_integer(
  "max_new_tokens", 128, "--mode=sample: tokens to generate.", lower_bound=1
)
flags.DEFINE_float("temperature", 0.8, "--mode=sample: 0 is greedy.")
flags.DEFINE_integer(
  "top_k", 40, "--mode=sample: sample among the k likeliest (0: all)."
)
flags.DEFINE_integer(
  "num_loops",
  None,
  "--mode=sample: recurrences (default: the trained R).",
  lower_bound=1,
)
flags.DEFINE_integer("sample_seed", 0, "--mode=sample: the sampling key's seed.")
flags.DEFINE_list("tasks", [], "--mode=lm_eval: lm-evaluation-harness task names.")
flags.DEFINE_string("include_path", None, "--mode=lm_eval: a folder of YAML tasks.")
flags.DEFINE_integer("num_fewshot", None, "--mode=lm_eval: few-shot examples.")
flags.DEFINE_float("limit", None, "--mode=lm_eval: examples per task (or a share).")
flags.DEFINE_bool(
  "apply_chat_template", False, "--mode=lm_eval: the model's chat template."
)
flags.DEFINE_list(
  "recurrences", [], "--mode=lm_eval: R values, one harness run each (default: R)."
)
flags.DEFINE_string(
  "exit", None, "--mode=lm_eval: a per-token exit rule (a halting criterion)."
)
flags.DEFINE_float("exit_threshold", None, "--mode=lm_eval: the exit rule's limit.")
flags.DEFINE_integer(
  "batch_size", 8, "--mode=lm_eval: requests per batch.", lower_bound=1
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
    rest = FLAGS(argv)
    if isinstance(FLAGS.config, config_flags.config_flags._ErrorConfig):
      FLAGS.config.lock()  # config_flags defers a failed load: raises it now
    return rest
  except OSError as e:
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "")
    path = path.split(":", 1)[0]
    why = "no such file" if not os.path.exists(path) else first_line(e.__cause__ or e)
    exit_with(f"--config={path}: cannot load the config file ({why})")
  except (flags.Error, ValueError, KeyError, AttributeError) as e:
    lines = [x for x in str(e).splitlines() if x.strip()] or [repr(e)]
    exit_with(lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}")


def _load_config(wd: Workdir):
  if FLAGS.config is not None:
    return FLAGS.config
  if FLAGS.mode != "train" and (saved := wd.saved_config()) is not None:
    return saved
  exit_with(
    "--config is required (for --mode=eval, analyze or sample, a workdir with "
    "config.json will do)"
  )


def _sampling() -> dict:
  """--mode=sample's flags, as `lm.generate.generate`'s arguments."""
  return dict(
    num_loops=FLAGS.num_loops,
    max_new_tokens=FLAGS.max_new_tokens,
    temperature=FLAGS.temperature,
    top_k=FLAGS.top_k,
    seed=FLAGS.sample_seed,
  )


def _lm_eval(config, workdir):
  """--mode=lm_eval: the `loopjax[lm_eval]` extra's harness on the model."""
  try:
    from loopjax.lm import harness
  except ImportError as e:
    raise ConfigError(
      f"--mode=lm_eval: needs lm-evaluation-harness ({first_line(e)}); "
      "pip install -e '.[lm_eval]'"
    ) from None
  try:
    recurrences = tuple(int(r) for r in FLAGS.recurrences)
  except ValueError:
    recurrences = (0,)
  if any(r < 1 for r in recurrences):
    raise ConfigError(
      f"--recurrences: a comma-separated list of integers >= 1; got "
      f"{','.join(FLAGS.recurrences)}"
    )
  harness.run(
    config, workdir, tasks=FLAGS.tasks, recurrences=recurrences, exit=FLAGS.exit,
    threshold=FLAGS.exit_threshold, include_path=FLAGS.include_path,
    num_fewshot=FLAGS.num_fewshot, limit=FLAGS.limit, step=FLAGS.step,
    apply_chat_template=FLAGS.apply_chat_template, batch_size=FLAGS.batch_size,
  )  # fmt: skip


def main(argv):
  if len(argv) > 1:
    exit_with(f"unexpected arguments: {' '.join(argv[1:])}")
  if not FLAGS.workdir:
    exit_with("--workdir is required")
  if FLAGS.follow and FLAGS.mode != "eval":
    exit_with("--follow: only with --mode=eval")
  if FLAGS.analyze and not FLAGS.follow:
    exit_with("--analyze: only with --mode=eval --follow (else --mode=analyze)")
  if FLAGS.follow and FLAGS.step is not None:
    exit_with("--step: not with --follow (it evaluates every checkpoint)")
  workdir = Path(FLAGS.workdir).expanduser()
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  if FLAGS.mode == "report":  # reads metrics files only: no config needed
    from loopjax import report

    try:
      paths = report.report(workdir)
    except FileNotFoundError as e:
      exit_with(str(e))
    print("wrote " + ", ".join(map(str, paths)))
    return
  try:
    # --follow: the workdir may not exist yet, its config comes later
    config = FLAGS.config if FLAGS.follow else _load_config(Workdir(workdir))
    if config is not None:
      config_lib.validate(config)
  except ConfigError as e:
    exit_with(str(e))
  import jax

  from loopjax import analyze, evaluate, follow, sharding, train
  from loopjax import task as task_lib
  from loopjax.pretrained import init_from

  try:
    sharding.initialize(
      FLAGS.distributed,
      FLAGS.coordinator_address,
      FLAGS.num_processes,
      FLAGS.process_id,
      FLAGS.heartbeat_timeout,
    )
  except ConfigError as e:
    exit_with(str(e))
  if FLAGS.mode != "train" and jax.process_count() > 1:
    exit_with(
      f"--mode={FLAGS.mode} runs in one process; leave out the multi-process flags"
    )
  try:
    # model.init_from: DIR's shapes, as training records them (it resolves its own)
    if config is not None and FLAGS.mode != "train":
      config = init_from.resolve(config)
    if config is not None and config.model.hf_dir and FLAGS.mode in ("train", "eval"):
      raise ConfigError(
        f"--mode={FLAGS.mode}: a pretrained model (model.hf_dir) takes "
        "--mode=analyze, --mode=sample or --mode=lm_eval"
      )
    if FLAGS.mode == "train":
      train.train_and_evaluate(config, workdir)
      print(
        f"outputs in {workdir}: metrics.jsonl, phases.json, checkpoints/; plots: "
        f"--mode=report; TensorBoard: tensorboard --logdir {workdir / 'tb'}"
      )
    elif FLAGS.follow:
      follow.follow(workdir, config, poll_s=FLAGS.poll_s, analyses=FLAGS.analyze)
    elif FLAGS.mode == "eval":
      Workdir(workdir).check(config)
      evaluate.evaluate_checkpoint(config, workdir, FLAGS.step)
    elif FLAGS.mode == "sample":
      if not config.model.hf_dir:  # a pretrained model records no run
        Workdir(workdir).check(config)
      family = task_lib.for_config(config)
      print(
        family.sample(config, workdir, FLAGS.prompt, step=FLAGS.step, **_sampling())
      )
    elif FLAGS.mode == "lm_eval":
      _lm_eval(config, workdir)
    elif config.model.hf_dir:
      from loopjax.lm import pretrained  # its analyses: matplotlib

      paths = pretrained.analyze(config, workdir)
      print("wrote " + ", ".join(map(str, paths)))
    else:
      Workdir(workdir).check(config)
      paths = analyze.analyze(config, workdir, FLAGS.step)
      print("wrote " + ", ".join(map(str, paths)))
  except ConfigError as e:
    exit_with(str(e))
  except (train.RunStopped, follow.TrainerStopped) as e:
    exit_with(str(e), code=1)
  except jax.errors.JaxRuntimeError as e:
    if jax.process_count() == 1:
      raise
    # A peer died mid-collective (or its device failed). Leave now: JAX's exit
    # barrier would wait out the heartbeat timeout and then abort.
    print(
      f"error: process {jax.process_index()}: a cross-process operation failed "
      f"({first_line(e)}); a peer process has probably died. Saved "
      "checkpoints are intact: rerun the same command on all hosts to resume",
      file=sys.stderr,
      flush=True,
    )
    sys.stdout.flush()
    os._exit(1)


if __name__ == "__main__":
  xla.apply_defaults()
  app.run(main, flags_parser=_parse)
