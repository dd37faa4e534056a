"""Entry point: trains, evaluates, analyzes or reports on a workdir.

  python -m loopjax.main --config=experiments/sysgen.py[:variant] --workdir=DIR \
      [--config.model.num_loops=8 ...] [--mode=train|eval|analyze|report] [--step=N]
  python -m loopjax.main --mode=eval --follow --workdir=DIR   # beside a trainer

Text from a language model: `python -m loopjax.sample`; lm-evaluation-harness
over a list of recurrences: `python -m loopjax.lm_eval`.
"""

from absl import flags

from loopjax import cli
from loopjax.errors import ConfigError

FLAGS = flags.FLAGS
flags.DEFINE_enum(
  "mode",
  "train",
  ["train", "eval", "analyze", "report"],
  "What to do with the workdir.",
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


def _checked_flags() -> None:
  if FLAGS.follow and FLAGS.mode != "eval":
    raise ConfigError("--follow: only with --mode=eval")
  if FLAGS.analyze and not FLAGS.follow:
    raise ConfigError("--analyze: only with --mode=eval --follow (else --mode=analyze)")
  if FLAGS.follow and FLAGS.step is not None:
    raise ConfigError("--step: not with --follow (it evaluates every checkpoint)")


def _run(config, workdir) -> None:
  """The mode, on a validated config (None: --follow waits for the run's)."""
  from loopjax import analyze, evaluate, follow, restore, train

  opens_a_directory = config is not None and restore.pretrained(config)
  if opens_a_directory and FLAGS.mode != "analyze":
    raise ConfigError(
      f"--mode={FLAGS.mode}: a pretrained model (model.hf_dir) takes "
      "--mode=analyze, python -m loopjax.sample or python -m loopjax.lm_eval"
    )
  if FLAGS.mode == "train":
    train.train_and_evaluate(config, workdir)
    print(
      f"outputs in {workdir}: metrics/, phases.json, checkpoints/; plots: "
      f"--mode=report; TensorBoard: tensorboard --logdir {workdir / 'tb'}"
    )
  elif FLAGS.follow:
    follow.follow(workdir, config, poll_s=FLAGS.poll_s, analyses=FLAGS.analyze)
  elif FLAGS.mode == "eval":
    evaluate.evaluate_checkpoint(config, workdir, FLAGS.step)
  elif opens_a_directory:
    from loopjax.lm import pretrained  # its analyses: matplotlib

    if paths := pretrained.analyze(config, workdir):  # process 0's
      print("wrote " + ", ".join(map(str, paths)))
  elif paths := analyze.analyze(config, workdir, FLAGS.step):  # process 0's
    print("wrote " + ", ".join(map(str, paths)))


def main(argv):
  workdir = cli.workdir(argv)
  _checked_flags()
  if FLAGS.mode == "report":  # reads metrics files only: no config needed
    from loopjax import report

    try:
      print("wrote " + ", ".join(map(str, report.report(workdir))))
    except FileNotFoundError as e:  # a folder without runs: the user's to fix
      raise ConfigError(str(e)) from None
    return
  import jax

  # --follow: the workdir may not exist yet, its config comes later
  follows = FLAGS.follow and FLAGS.config is None
  config = None if follows else cli.config(workdir, FLAGS.mode == "train")
  with cli.processes():
    if jax.process_count() > 1 and FLAGS.follow:
      raise ConfigError(
        "--follow runs in one process (every other mode runs on several); "
        "leave out the multi-process flags"
      )
    _run(config, workdir)


if __name__ == "__main__":
  cli.run(main)
