"""Entry point: text from a language model, a run's checkpoint or a
pretrained directory (`model.hf_dir`), by `lm.generate`.

  python -m loopjax.sample --workdir=runs/lm --prompt="def " [--num_loops=8]
  python -m loopjax.sample --config=experiments/pretrained.py:huginn \
      --config.model.hf_dir=DIR --workdir=runs/huginn --prompt="..." --num_loops=32

On several processes (the multi-process flags, as `loopjax.main` takes them)
the model spans every process's devices; process 0 prints the text.
"""

from absl import flags

from loopjax import cli, sharding
from loopjax.field_rules import MAX_ITERATIONS
from loopjax.workdir import Workdir

FLAGS = flags.FLAGS
flags.DEFINE_string("prompt", "", "The text to continue.")
flags.DEFINE_integer(
  "max_new_tokens",
  None,
  "Tokens to generate (default: up to 128, as many as the model's positions "
  "leave after the prompt).",
  lower_bound=1,
)
flags.DEFINE_float("temperature", 0.8, "0 is greedy.", lower_bound=0.0)
flags.DEFINE_integer(
  "top_k", 40, "Sample among the k likeliest (0: all).", lower_bound=0
)
flags.DEFINE_integer(
  "num_loops",
  None,
  "Recurrences (default: the trained R).",
  lower_bound=1,
  upper_bound=MAX_ITERATIONS,
)
flags.DEFINE_integer("seed", 0, "The sampling key's seed.")


def main(argv):
  workdir = cli.workdir(argv)
  config = cli.config(workdir)

  from loopjax import restore
  from loopjax import task as task_lib

  if not restore.pretrained(config):  # a pretrained model records no run
    Workdir(workdir).check(config)
  with cli.processes():  # the model on every process's devices
    text = task_lib.for_config(config).sample(
      config, workdir, FLAGS.prompt, step=FLAGS.step, num_loops=FLAGS.num_loops,
      max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
      top_k=FLAGS.top_k, seed=FLAGS.seed,
    )  # fmt: skip
  if sharding.writes():  # every process has the text: one prints it
    print(text)


if __name__ == "__main__":
  cli.run(main)
