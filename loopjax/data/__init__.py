"""Task data as integer arrays: knowledge graphs generated (stored via TFDS) or
the papers' JSON; text corpora tokenized for the language-model task (lm.py)."""

import dataclasses

from loopjax.data import grokked_json, lm, tfds_kg
from loopjax.data.kg import TaskData, Vocab, fingerprint, probes, train_split
from loopjax.errors import ConfigError

__all__ = [
  "TaskData",
  "Vocab",
  "fingerprint",
  "knowledge_graph",
  "probes",
  "text",
  "train_split",
]

_JSON = "grokked_json:"


def text(data_cfg) -> lm.LmData:
  """A language model's token streams (lm.py)."""
  return _prepared(lambda: lm.read(data_cfg), data_cfg)


def knowledge_graph(data_cfg) -> TaskData:
  """A knowledge graph's splits: generated, or the papers' JSON."""
  if data_cfg.source.startswith(_JSON):  # config.validate: KG tasks only
    task = grokked_json.load(data_cfg.source.removeprefix(_JSON), data_cfg.task)
  else:
    task = _prepared(lambda: tfds_kg.read(data_cfg), data_cfg)
  return dataclasses.replace(task, pad_to=data_cfg.pad_to)


def _prepared(read, data_cfg):
  try:
    return read()
  except OSError as e:  # data_dir not creatable or writable, disk full
    raise ConfigError(
      f"data.data_dir: cannot prepare the dataset in {data_cfg.data_dir!r} "
      f"({e.strerror or e}); pick a writable directory"
    ) from e
