"""Task data as integer arrays: knowledge graphs generated (stored via TFDS) or
the papers' JSON; text corpora tokenized for the language-model task (lm.py)."""

from loopjax.data import grokked_json, lm, tfds_kg
from loopjax.data.kg import TaskData, Vocab, fingerprint, probes, train_split
from loopjax.errors import ConfigError

__all__ = [
  "TaskData",
  "Vocab",
  "fingerprint",
  "load",
  "probes",
  "train_split",
]

_JSON = "grokked_json:"


def load(data_cfg) -> TaskData | lm.LmData:
  """The splits that `data_cfg.source` names."""
  if data_cfg.source.startswith(_JSON):  # config.validate: KG tasks only
    return grokked_json.load(data_cfg.source.removeprefix(_JSON), data_cfg.task)
  try:
    return lm.read(data_cfg) if data_cfg.task == "lm" else tfds_kg.read(data_cfg)
  except OSError as e:  # data_dir not creatable or writable, disk full
    raise ConfigError(
      f"data.data_dir: cannot prepare the dataset in {data_cfg.data_dir!r} "
      f"({e.strerror or e}); pick a writable directory"
    ) from e
