"""Task data as integer arrays. This package's shared code (pipeline.py,
packing.py, tfds_store.py, corpus.py) knows no task family: each family's
own data module (kg.py with tfds_kg.py and grokked_json.py; lm.py) is
imported by its family (kg/source.py, lm/task.py), never from here."""

from loopjax.errors import ConfigError

__all__ = ["prepared"]


def prepared(read, data_cfg):
  """`read()`, a data set prepared under data.data_dir, with a data_dir that
  cannot be made or written (or a full disk) as one line."""
  try:
    return read()
  except OSError as e:  # data_dir not creatable or writable, disk full
    raise ConfigError(
      f"data.data_dir: cannot prepare the dataset in {data_cfg.data_dir!r} "
      f"({e.strerror or e}); pick a writable directory"
    ) from e
