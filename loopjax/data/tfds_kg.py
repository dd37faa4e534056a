"""Generated composition data stored as a TFDS dataset (array_record) under data_dir.

Preparing once and reading back with random access (no TensorFlow) lets every run
and host share the same bytes; the stored fingerprint catches corruption.
"""

import dataclasses
import fcntl
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds

from loopjax.config import ConfigError
from loopjax.data import kg

# kg.composition's arguments, read from the `data` config section.
PARAMS = {
  "num_entities": int,
  "num_relations": int,
  "out_degree": int,
  "ood_ratio": float,
  "p_test_id": float,
  "phi": float,
  "probe_size": int,
  "seed": int,
}
_NAME = (
  "e{num_entities}_r{num_relations}_d{out_degree}_ood{ood_ratio!r}"
  "_pt{p_test_id!r}_phi{phi!r}_n{probe_size}_s{seed}"
)


@dataclasses.dataclass(eq=False)
class KgConfig(tfds.core.BuilderConfig):
  params: dict = dataclasses.field(default_factory=dict)


class KgComposition(tfds.core.GeneratorBasedBuilder):
  """kg.composition's splits; bump VERSION whenever the generator's output changes."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self) -> tfds.core.DatasetInfo:
    params = self.builder_config.params
    return tfds.core.DatasetInfo(
      builder=self,
      features=tfds.features.FeaturesDict(
        {
          "inputs": tfds.features.Tensor(shape=(3,), dtype=np.int32),
          "target": tfds.features.Scalar(dtype=np.int32),
          "bridge": tfds.features.Scalar(dtype=np.int32),
          "index": tfds.features.Scalar(dtype=np.int64),  # position in kg's split
        }
      ),
      metadata=tfds.core.MetadataDict(
        num_entities=params["num_entities"], num_relations=params["num_relations"]
      ),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    data = kg.composition(**self.builder_config.params)
    self.info.metadata["fingerprint"] = kg.fingerprint(data)
    # TFDS cannot write an empty split; read() restores missing ones as empty.
    return {
      name: self._generate_examples(split)
      for name, split in data.splits.items()
      if len(split["target"])
    }

  def _generate_examples(self, split: kg.Split):
    for i, (inputs, target, bridge) in enumerate(
      zip(split["inputs"], split["target"], split["bridge"], strict=True)
    ):
      yield i, {"inputs": inputs, "target": target, "bridge": bridge, "index": i}


def _params(data_cfg) -> dict:
  return {k: cast(data_cfg[k]) for k, cast in PARAMS.items()}


def config_name(data_cfg) -> str:
  """Names the dataset by every generator argument, exactly (floats by repr)."""
  return _NAME.format(**_params(data_cfg))


def _builder(data_cfg) -> KgComposition:
  config = KgConfig(name=config_name(data_cfg), params=_params(data_cfg))
  return KgComposition(config=config, data_dir=Path(data_cfg.data_dir).expanduser())


def _prepared(data_cfg) -> KgComposition:
  """Prepares under an exclusive file lock: parallel runs share one data_dir."""
  root = Path(data_cfg.data_dir).expanduser()
  root.mkdir(parents=True, exist_ok=True)
  with open(root / f"{config_name(data_cfg)}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    builder = _builder(data_cfg)
    builder.download_and_prepare(file_format="array_record")  # no-op once prepared
  return builder


def prepare(data_cfg) -> Path:
  """Generates and writes the dataset unless data_dir already holds it."""
  return Path(_prepared(data_cfg).data_dir)


def read(data_cfg) -> kg.TaskData:
  """All splits as numpy columns in the generator's order, fingerprint-checked."""
  builder = _prepared(data_cfg)
  sources = builder.as_data_source()
  splits = {
    name: _columns(sources[name]) if name in sources else _empty() for name in kg.SPLITS
  }
  meta = builder.info.metadata
  data = kg.TaskData(kg.Vocab(meta["num_entities"], meta["num_relations"]), splits)
  if (found := kg.fingerprint(data)) != meta["fingerprint"]:
    raise ConfigError(
      f"{builder.data_dir}: fingerprint {found} != stored "
      f"{meta['fingerprint']}; the data on disk is corrupt, delete it"
    )
  return data


def _columns(source) -> kg.Split:
  records = source.__getitems__(range(len(source)))
  order = np.argsort([r["index"] for r in records])
  return {
    key: np.stack([r[key] for r in records])[order].astype(np.int32)
    for key in ("inputs", "target", "bridge")
  }


def _empty() -> kg.Split:
  return {
    "inputs": np.zeros((0, 3), np.int32),
    "target": np.zeros(0, np.int32),
    "bridge": np.zeros(0, np.int32),
  }
