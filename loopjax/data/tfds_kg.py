"""Generated tasks stored as TFDS datasets (array_record) under data_dir.

Preparing once and reading back with random access (no TensorFlow) lets every run
and host share the same bytes; the stored fingerprint catches corruption. One
builder per task (`composition`, `chains`); a builder config is named by every
argument of the task's generator, so different settings never share files.
"""

import dataclasses
import fcntl
import logging
import sys
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds

from loopjax.data import kg
from loopjax.errors import ConfigError, first_line


class _NoCustomConfigWarning(logging.Filter):
  """TFDS warns about every builder config it does not predefine; ours never
  are (one per generator argument set), so the warning is noise on every run."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Using custom data configuration")


logging.getLogger("absl").addFilter(_NoCustomConfigWarning())


@dataclasses.dataclass(frozen=True)
class _Task:
  generate: object  # kg.composition or kg.chains
  params: dict  # the generator's arguments, read from the `data` config section
  name: str  # the builder config's name, formatted from params


TASKS = {
  "composition": _Task(
    kg.composition,
    {
      "num_entities": int,
      "num_relations": int,
      "out_degree": int,
      "ood_ratio": float,
      "p_test_id": float,
      "phi": float,
      "probe_size": int,
      "seed": int,
    },
    "e{num_entities}_r{num_relations}_d{out_degree}_ood{ood_ratio!r}"
    "_pt{p_test_id!r}_phi{phi!r}_n{probe_size}_s{seed}",
  ),
  "chains": _Task(
    kg.chains,
    {
      "num_entities": int,
      "num_relations": int,
      "max_hops": int,
      "train_per_hop": int,
      "test_per_hop": int,
      "val_per_hop": int,
      "seed": int,
    },
    "e{num_entities}_r{num_relations}_k{max_hops}_n{train_per_hop}"
    "_t{test_per_hop}_v{val_per_hop}_s{seed}",
  ),
}


@dataclasses.dataclass(eq=False)
class KgConfig(tfds.core.BuilderConfig):
  params: dict = dataclasses.field(default_factory=dict)


class _Builder:
  """What both builders share; bump a builder's VERSION whenever its generator's
  output changes."""

  TASK: str

  def _info(self) -> tfds.core.DatasetInfo:
    params = self.builder_config.params
    shapes = kg.column_shapes(self.TASK, params)
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
    data = TASKS[self.TASK].generate(**self.builder_config.params)
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

  TASK = "composition"
  VERSION = tfds.core.Version("1.0.0")


class KgChains(_Builder, tfds.core.GeneratorBasedBuilder):
  """kg.chains's splits."""

  TASK = "chains"
  VERSION = tfds.core.Version("1.0.0")


_BUILDERS = {b.TASK: b for b in (KgComposition, KgChains)}


def params(data_cfg) -> dict:
  """The task generator's arguments from the `data` config section."""
  return {k: cast(data_cfg[k]) for k, cast in TASKS[data_cfg.task].params.items()}


def generate(data_cfg) -> kg.TaskData:
  """The task in memory, without TFDS (benchmarks, tests)."""
  return TASKS[data_cfg.task].generate(**params(data_cfg))


def config_name(data_cfg) -> str:
  """Names the dataset by every generator argument, exactly (floats by repr)."""
  return TASKS[data_cfg.task].name.format(**params(data_cfg))


def _builder(data_cfg):
  config = KgConfig(name=config_name(data_cfg), params=params(data_cfg))
  return _BUILDERS[data_cfg.task](
    config=config, data_dir=Path(data_cfg.data_dir).expanduser()
  )


def _prepared(data_cfg):
  root = Path(data_cfg.data_dir).expanduser()
  name = f"{data_cfg.task}_{config_name(data_cfg)}"
  return prepare_once(root, name, lambda: _builder(data_cfg))


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
