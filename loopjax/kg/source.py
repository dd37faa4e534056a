"""Where a knowledge-graph run's data come from: generated from the config's
seed and stored via TFDS (data/tfds_kg.py), or the papers' JSON
(`data.source=grokked_json:DIR`, data/grokked_json.py). The batch layout
(`data.pad_to`) is set here, once: everything downstream reads it from the
task (`TaskData.pad_to`)."""

import dataclasses

from loopjax import data
from loopjax.data import grokked_json, tfds_kg
from loopjax.data.kg import TaskData

_JSON = "grokked_json:"


def knowledge_graph(data_cfg) -> TaskData:
  """A knowledge graph's splits: generated, or the papers' JSON."""
  if data_cfg.source.startswith(_JSON):  # config.validate: KG tasks only
    task = grokked_json.load(data_cfg.source.removeprefix(_JSON), data_cfg.task)
  else:
    task = data.prepared(lambda: tfds_kg.read(data_cfg), data_cfg)
  return dataclasses.replace(task, pad_to=data_cfg.pad_to)


def export(config, out_dir) -> None:
  """`python -m loopjax.data export`: the task in the papers' JSON files."""
  grokked_json.export(knowledge_graph(config.data), out_dir)
