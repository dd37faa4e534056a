"""Exports a config's data in the papers' JSON format, for their code to use.

python -m loopjax.data export --config=experiments/sysgen.py:tiny --out=DIR
"""

from absl import flags

from loopjax import cli, task
from loopjax import config as config_lib
from loopjax.errors import ConfigError
from loopjax.names import imported

FLAGS = flags.FLAGS  # --config: cli's, loaded as every entry point loads it
_OUT = flags.DEFINE_string("out", None, "Directory to write the JSON files to.")


def main(argv):
  if argv[1:] != ["export"]:
    raise ConfigError(f"expected the command 'export'; got {argv[1:]}")
  if FLAGS.config is None or not _OUT.value:
    raise ConfigError("export: --config and --out=DIR are required")
  config_lib.validate(FLAGS.config)
  if (export := task.spec(FLAGS.config.data.task).export) is None:
    raise ConfigError(
      f"export: data.task {FLAGS.config.data.task!r} has no papers' JSON format"
    )
  imported(export)(FLAGS.config, _OUT.value)
  print(f"wrote the papers' JSON files (train, valid, test, vocab) to {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
