"""Task data as integer arrays: generated (stored via TFDS) or the papers' JSON."""

from loopjax.data import grokked_json, tfds_kg
from loopjax.data.kg import TaskData, Vocab, fingerprint, probes, train_split
from loopjax.errors import ConfigError

__all__ = ["TaskData", "Vocab", "fingerprint", "load", "probes", "train_split"]

_JSON = "grokked_json:"


def load(data_cfg) -> TaskData:
  """The splits that `data_cfg.source` names."""
  if data_cfg.source == "generate":
    try:
      return tfds_kg.read(data_cfg)
    except OSError as e:  # data_dir not creatable or writable, disk full
      raise ConfigError(
        f"data.data_dir: cannot prepare the dataset in {data_cfg.data_dir!r} "
        f"({e.strerror or e}); pick a writable directory"
      ) from e
  # config.validate allows nothing else
  return grokked_json.load(data_cfg.source.removeprefix(_JSON), data_cfg.task)
