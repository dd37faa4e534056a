"""Datasets stored via TFDS (array_record) under a data_dir, prepared once:
what every family's TFDS builder shares (data/tfds_kg.py, data/lm.py).
Preparing once and reading back with random access (no TensorFlow) lets every
run and host share the same bytes.
"""

import fcntl
import logging
import sys
from pathlib import Path

import tensorflow_datasets as tfds

from loopjax.errors import ConfigError, first_line


class _NoCustomConfigWarning(logging.Filter):
  """TFDS warns about every builder config it does not predefine; ours never
  are (one per generator argument set), so the warning is noise on every run."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Using custom data configuration")


logging.getLogger("absl").addFilter(_NoCustomConfigWarning())


def prepare_once(root: Path, name: str, make_builder):
  """`make_builder()`'s dataset, prepared (array_record) unless root holds it,
  under an exclusive file lock `root/<name>.lock`: parallel runs share one
  data_dir and prepare it once."""
  root.mkdir(parents=True, exist_ok=True)
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    builder = make_builder()
    if not builder.is_prepared():
      bars = sys.stderr.isatty()  # logs (SLURM, nohup): no carriage-return bars
      tfds.display_progress_bar(bars)
      try:
        builder.download_and_prepare(file_format="array_record")
      except (OSError, RuntimeError) as e:  # array_record: RuntimeError("write()..")
        if isinstance(e, RuntimeError) and "write" not in str(e):
          raise
        raise ConfigError(
          f"data.data_dir={root}: cannot write the dataset ({first_line(e, 160)}); "
          "free space there or give another data.data_dir"
        ) from None
      finally:
        tfds.display_progress_bar(True)  # TFDS's default
  return builder
