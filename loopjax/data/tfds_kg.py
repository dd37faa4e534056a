"""Generated tasks stored as TFDS datasets (array_record) under data_dir.

Preparing once and reading back with random access (no TensorFlow) lets every run
and host share the same bytes; the stored fingerprint catches corruption. One
builder per task (`kg.KINDS`); a builder config is named by every
argument of the task's generator, so different settings never share files.
"""

import dataclasses
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds

from loopjax.data import kg, tfds_store
from loopjax.errors import ConfigError


@dataclasses.dataclass(eq=False)
class KgConfig(tfds.core.BuilderConfig):
  params: dict = dataclasses.field(default_factory=dict)


class _Builder:
  """What both builders share; bump a builder's VERSION whenever its generator's
  output changes."""

  KIND: kg.Kind

  def _info(self) -> tfds.core.DatasetInfo:
    params = self.builder_config.params
    shapes = self.KIND.column_shapes(params)
    features = {
      key: tfds.features.Tensor(shape=shape, dtype=np.int32)
      for key, shape in shapes.items()
    }
    features["index"] = tfds.features.Scalar(dtype=np.int64)  # position in the split
    return tfds.core.DatasetInfo(
      builder=self,
      features=tfds.features.FeaturesDict(features),
      metadata=tfds.core.MetadataDict(
        num_entities=params["num_entities"], num_relations=params["num_relations"]
      ),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    data = self.KIND.generate(**self.builder_config.params)
    self.info.metadata["fingerprint"] = kg.fingerprint(data)
    # TFDS cannot write an empty split; read() restores missing ones as empty.
    return {
      name: self._generate_examples(split)
      for name, split in data.splits.items()
      if len(split["target"])
    }

  def _generate_examples(self, split: kg.Split):
    for i in range(len(split["target"])):
      yield i, {key: column[i] for key, column in split.items()} | {"index": i}


class KgComposition(_Builder, tfds.core.GeneratorBasedBuilder):
  """kg.composition's splits."""

  KIND = kg.COMPOSITION
  VERSION = tfds.core.Version("1.0.0")


class KgChains(_Builder, tfds.core.GeneratorBasedBuilder):
  """kg.chains's splits."""

  KIND = kg.CHAINS
  VERSION = tfds.core.Version("1.0.0")


_BUILDERS = {b.KIND.name: b for b in (KgComposition, KgChains)}


def params(data_cfg) -> dict:
  """The task generator's arguments from the `data` config section."""
  return {k: cast(data_cfg[k]) for k, cast in kg.KINDS[data_cfg.task].params.items()}


def generate(data_cfg) -> kg.TaskData:
  """The task in memory, without TFDS (benchmarks, tests)."""
  return kg.KINDS[data_cfg.task].generate(**params(data_cfg))


def config_name(data_cfg) -> str:
  """Names the dataset by every generator argument, exactly (floats by repr)."""
  return kg.KINDS[data_cfg.task].config_name.format(**params(data_cfg))


def _builder(data_cfg):
  config = KgConfig(name=config_name(data_cfg), params=params(data_cfg))
  return _BUILDERS[data_cfg.task](
    config=config, data_dir=Path(data_cfg.data_dir).expanduser()
  )


def _prepared(data_cfg):
  root = Path(data_cfg.data_dir).expanduser()
  name = f"{data_cfg.task}_{config_name(data_cfg)}"
  return tfds_store.prepare_once(root, name, lambda: _builder(data_cfg))


def prepare(data_cfg) -> Path:
  """Generates and writes the dataset unless data_dir already holds it."""
  return Path(_prepared(data_cfg).data_dir)


def read(data_cfg) -> kg.TaskData:
  """All splits as numpy columns in the generator's order, fingerprint-checked."""
  builder = _prepared(data_cfg)
  sources = builder.as_data_source()
  shapes = kg.column_shapes(data_cfg.task, builder.builder_config.params)
  splits = {
    name: _columns(sources[name], shapes)
    if name in sources
    else {key: np.zeros((0, *shape), np.int32) for key, shape in shapes.items()}
    for name in kg.split_names(data_cfg.task, builder.builder_config.params)
  }
  meta = builder.info.metadata
  vocab = kg.Vocab(meta["num_entities"], meta["num_relations"])
  data = kg.TaskData(vocab, splits, data_cfg.task)
  if (found := kg.fingerprint(data)) != meta["fingerprint"]:
    raise ConfigError(
      f"{builder.data_dir}: fingerprint {found} != stored "
      f"{meta['fingerprint']}; the data on disk is corrupt, delete it"
    )
  return data


def _columns(source, shapes) -> kg.Split:
  records = source.__getitems__(range(len(source)))
  order = np.argsort([r["index"] for r in records])
  return {
    key: np.stack([r[key] for r in records])[order].astype(np.int32) for key in shapes
  }
