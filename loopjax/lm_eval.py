"""Entry point: lm-evaluation-harness on a language model at each of a list
of recurrences, into `<workdir>/lm_eval` (`lm.harness.run`; the
`loopjax[lm_eval]` extra). The harness's own command line, with every one of
its flags, is `python -m loopjax.lm.harness --model loopjax`.

  python -m loopjax.lm_eval --workdir=runs/lm --tasks=TASK --num_loops=1,4,8
  python -m loopjax.lm_eval --config=experiments/pretrained.py:huginn \
      --config.model.hf_dir=DIR --workdir=runs/huginn_eval \
      --tasks=arc_easy,hellaswag --num_loops=4,8,16,32

On several processes (the multi-process flags, as `loopjax.main` takes them)
the model spans every process's devices and scores each batch on all of them;
process 0 writes (`lm.harness.run`).
"""

from absl import flags

from loopjax import cli
from loopjax.errors import ConfigError, first_line
from loopjax.field_rules import MAX_ITERATIONS

FLAGS = flags.FLAGS
flags.DEFINE_list("tasks", [], "lm-evaluation-harness task names.")
flags.DEFINE_string("include_path", None, "A folder of YAML tasks.")
flags.DEFINE_list(
  "num_loops", [], "Recurrences, one harness run each (default: model.num_loops)."
)
flags.DEFINE_integer("num_fewshot", None, "Few-shot examples.")
flags.DEFINE_float("limit", None, "Examples per task (or a share).")
flags.DEFINE_bool("apply_chat_template", False, "The model's chat template.")
flags.DEFINE_string("exit", None, "A per-token exit rule (a halting criterion).")
flags.DEFINE_float("exit_threshold", None, "The exit rule's limit.")
flags.DEFINE_integer("batch_size", 8, "Requests per batch.", lower_bound=1)


def _recurrences() -> tuple[int, ...]:
  try:
    loops = tuple(int(r) for r in FLAGS.num_loops)
  except ValueError:
    loops = (0,)
  if any(not 1 <= r <= MAX_ITERATIONS for r in loops):
    raise ConfigError(
      f"--num_loops: a comma-separated list of integers in [1, {MAX_ITERATIONS}]; got "
      f"{','.join(FLAGS.num_loops)}"
    )
  return loops


def main(argv):
  workdir = cli.workdir(argv)
  config = cli.config(workdir)
  loops = _recurrences()
  try:
    from loopjax.lm import harness
  except ImportError as e:
    raise ConfigError(
      f"needs lm-evaluation-harness ({first_line(e)}); pip install -e '.[lm_eval]'"
    ) from None
  with cli.processes():  # the model on every process's devices
    harness.run(
      config, workdir, tasks=FLAGS.tasks, recurrences=loops, exit=FLAGS.exit,
      threshold=FLAGS.exit_threshold, include_path=FLAGS.include_path,
      num_fewshot=FLAGS.num_fewshot, limit=FLAGS.limit, step=FLAGS.step,
      apply_chat_template=FLAGS.apply_chat_template, batch_size=FLAGS.batch_size,
    )  # fmt: skip


if __name__ == "__main__":
  cli.run(main)
