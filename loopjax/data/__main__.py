"""Exports a config's data in the papers' JSON format, for their code to use.

python -m loopjax.data export --config=experiments/sysgen.py:tiny --out=DIR
"""

from absl import app, flags
from ml_collections import config_flags

from loopjax import config as config_lib
from loopjax import data
from loopjax.data import grokked_json
from loopjax.errors import ConfigError, exit_with

_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
_OUT = flags.DEFINE_string(
  "out", None, "Directory to write the JSON files to.", required=True
)


def main(argv):
  if argv[1:] != ["export"]:
    raise app.UsageError(f"expected the command 'export'; got {argv[1:]}")
  try:
    config_lib.validate(_CONFIG.value)
    grokked_json.export(data.knowledge_graph(_CONFIG.value.data), _OUT.value)
  except ConfigError as e:
    exit_with(str(e))
  print(f"wrote the papers' JSON files (train, valid, test, vocab) to {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
