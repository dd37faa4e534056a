"""Knowledge-graph tasks as int arrays, everything derived from one seed.

`composition` (2-hop, "Grokked Transformers", Wang et al. 2024): a random graph
gives atomic facts (h, r) -> t; chaining two gives inferred facts (h, r1, r2) -> t
through a bridge entity b. Some atomic facts are OOD: trained on only as atomic
facts, so inferred facts whose two hops are both OOD test systematic composition.

`chains` (k-hop, "Loop, Think, & Generalize"): every relation is a permutation of
the entities; chains (h, r1..rk) -> t for k = 2..K test depth extrapolation.

In both, an example's answer is read at its last real token (position k for k
hops; atomic facts are 1 hop), and padding follows it.
"""

import dataclasses
import hashlib
from collections.abc import Callable

import numpy as np

from loopjax.data import kg_generate

SPLITS = (
  "train",
  "id_atomic",
  "ood_atomic",
  "train_inferred",
  "test_inferred_id",
  "test_inferred_ood",
)
PROBES = SPLITS[1:]


def split_names(task: str, params: dict) -> tuple[str, ...]:
  """The splits a task's generator returns, in order."""
  return KINDS[task].split_names(params)


def column_shapes(task: str, params: dict) -> dict[str, tuple[int, ...]]:
  """Each column's per-example shape (all int32)."""
  return KINDS[task].column_shapes(params)


@dataclasses.dataclass(frozen=True)
class Vocab:
  """Token ids: entities [0, E), relations [E, E+R), then pad."""

  num_entities: int
  num_relations: int

  @property
  def pad_id(self) -> int:
    return self.num_entities + self.num_relations

  @property
  def vocab_size(self) -> int:
    return self.pad_id + 1


# Columns (int32; shapes: column_shapes). Composition: "inputs" (N, 3), [h, r, pad]
# for atomic facts, [h, r1, r2] for inferred ones; "target" (N,); "bridge" (N,),
# -1 for atomic facts. Chains: "inputs" (N, K + 1), "target", "bridges" (N, K - 1).
Split = dict[str, np.ndarray]


def hop_count(split_name: str) -> int | None:
  """k of a chains split named `train_k<k>` / `test_k<k>` / `val_k<k>`, else None."""
  head, sep, k = split_name.rpartition("_k")
  return int(k) if sep and head in ("train", "test", "val") and k.isdigit() else None


def sample(split: Split, n: int, seed: int) -> Split:
  """n examples of a split (all if fewer), the same for the same seed, in order."""
  keep = np.sort(np.random.default_rng(seed).permutation(len(split["target"]))[:n])
  return {key: column[keep] for key, column in split.items()}


@dataclasses.dataclass(frozen=True)
class TaskData:
  vocab: Vocab
  splits: dict[str, Split]  # keyed by split_names(task, ...)
  task: str = "composition"
  pad_to: int = 0  # chains: data.pad_to (the answer read at a pad column)

  @property
  def max_hops(self) -> int:
    """The longest chain the task holds (2 for composition)."""
    return self.splits[next(iter(self.splits))]["inputs"].shape[1] - 1

  def model_dims(self) -> tuple[int, int]:
    """(vocab size, longest sequence) the model is built for."""
    return self.vocab.vocab_size, max(self.max_hops + 1, self.pad_to)

  def summary(self) -> dict:
    """What a workdir's dataset.json records: fingerprint, sizes, vocab size."""
    return {
      "fingerprint": fingerprint(self),
      "sizes": {k: len(v["target"]) for k, v in self.splits.items()},
      "vocab_size": self.vocab.vocab_size,
    }


def without_examples(data_cfg) -> TaskData:
  """A config's task with its vocabulary and chain length but no examples:
  what building a model needs (ahead-of-time compiles, from the config alone)."""
  K = KINDS[data_cfg.task].longest(data_cfg)
  empty = {"inputs": np.zeros((0, K + 1), np.int32), "target": np.zeros(0, np.int32)}
  vocab = Vocab(data_cfg.num_entities, data_cfg.num_relations)
  return TaskData(vocab, {"train": empty}, data_cfg.task, data_cfg.pad_to)


def train_split(data: TaskData, max_hops: int) -> Split:
  """What training samples from (see each Kind's `train_split`)."""
  return KINDS[data.task].train_split(data, max_hops)


def probes(data: TaskData, train_hops: int = 0, size: int = 0) -> dict[str, Split]:
  """The splits evaluations report, none empty (see each Kind's `probes`)."""
  out = KINDS[data.task].probes(data, train_hops, size)
  return {n: s for n, s in out.items() if len(s["target"])}


def _composition_train(data: TaskData, max_hops: int) -> Split:
  """Composition trains on its `train` split."""
  return data.splits["train"]


def _composition_probes(data: TaskData, train_hops: int, size: int) -> dict:
  """Every split but `train`."""
  return {n: s for n, s in data.splits.items() if n != "train"}


def _chains_train(data: TaskData, max_hops: int) -> Split:
  """The atomic facts and the train chains of up to `max_hops` hops (a
  curriculum stage), padded to max_hops + 1 tokens only (compute grows with
  length)."""
  names = ["atomic"] + [f"train_k{k}" for k in range(2, max_hops + 1)]
  return {
    "inputs": np.concatenate([data.splits[n]["inputs"] for n in names])[
      :, : max_hops + 1
    ],
    "target": np.concatenate([data.splits[n]["target"] for n in names]),
  }


def _chains_probes(data: TaskData, train_hops: int, size: int) -> dict:
  """Every `test_k<k>`; each `val_k<k>` with k <= train_hops (what halting
  thresholds are tuned on: trained depths only, never the test chains);
  samples of `size` (fixed, the first after a seeded shuffle) from the atomic
  facts and from each `train_k<k>` with k <= train_hops (memorization)."""
  out = {}
  for name, split in data.splits.items():
    k = hop_count(name) or 1  # the atomic facts: 1 hop
    if name.startswith("test_"):
      out[name] = split
    elif name.startswith("val_"):
      if k <= train_hops:
        out[name] = split
    elif k <= train_hops:
      out[name] = sample(split, size, seed=k)
  return out


def _chains_splits(params: dict) -> tuple[str, ...]:
  ks = range(2, params["max_hops"] + 1)
  kinds = ("train", "test", "val") if params.get("val_per_hop") else ("train", "test")
  return ("atomic", *(f"{s}_k{k}" for k in ks for s in kinds))


def composition(**params) -> TaskData:
  """Generates the 2-hop composition task; same arguments, same arrays
  (kg_generate.py)."""
  vocab = Vocab(params["num_entities"], params["num_relations"])
  return TaskData(vocab, kg_generate.composition(vocab=vocab, **params), "composition")


def first_bridge(split: Split) -> np.ndarray:
  """The first hop's result per query, (N,); -1 where there is none (atomic)."""
  if "bridge" in split:
    return split["bridge"]
  b_NK = split["bridges"]
  return b_NK[:, 0] if b_NK.shape[1] else np.full(len(split["target"]), -1)


def hops(split: Split, pad_id: int) -> tuple[Split, Split]:
  """The two atomic facts behind each inferred fact: (h, r1) -> b, (b, r2) -> t."""
  h_N, r1_N, r2_N = split["inputs"].T
  b_N, pad_N, none_N = split["bridge"], np.full_like(h_N, pad_id), np.full_like(h_N, -1)
  return (
    {"inputs": np.stack([h_N, r1_N, pad_N], 1), "target": b_N, "bridge": none_N},
    {
      "inputs": np.stack([b_N, r2_N, pad_N], 1),
      "target": split["target"],
      "bridge": none_N,
    },
  )


def fingerprint(data: TaskData) -> str:
  """sha256 of the vocab and every array, independent of platform byte order
  (the task is implied by the split names)."""
  h = hashlib.sha256(f"{data.vocab.num_entities},{data.vocab.num_relations}".encode())
  for name in sorted(data.splits):
    for key in sorted(data.splits[name]):
      a = np.ascontiguousarray(data.splits[name][key])
      a = a.astype(a.dtype.newbyteorder("<"), copy=False)
      h.update(f"|{name}/{key}:{a.dtype.str}:{a.shape}|".encode())
      h.update(a.tobytes())
  return h.hexdigest()


def chains(**params) -> TaskData:
  """k-hop chains (LTG's depth extrapolation), the same for the same
  arguments (kg_generate.py)."""
  vocab = Vocab(params["num_entities"], params["num_relations"])
  return TaskData(vocab, kg_generate.chains(vocab=vocab, **params), "chains")


@dataclasses.dataclass(frozen=True)
class Kind:
  """What differs between the knowledge-graph tasks' data, as a record: the
  shared functions above look a task's up by its name (`KINDS`) instead of
  asking which task they serve. A new task is a Kind and one line there."""

  name: str  # data.task, and the TFDS builder's
  generate: Callable[..., TaskData]  # the generator (its arguments: `params`)
  params: dict  # generator argument -> its type, read from the `data` section
  config_name: str  # the TFDS builder config's name, formatted from params
  split_names: Callable[[dict], tuple[str, ...]]  # params -> the splits, in order
  column_shapes: Callable[[dict], dict]  # params -> each column's shape
  longest: Callable  # data config -> the longest chain (hops)
  train_split: Callable[[TaskData, int], Split]
  probes: Callable[[TaskData, int, int], dict]


COMPOSITION = Kind(
  "composition",
  composition,
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
  split_names=lambda params: SPLITS,
  column_shapes=lambda params: {"inputs": (3,), "target": (), "bridge": ()},
  longest=lambda data_cfg: 2,
  train_split=_composition_train,
  probes=_composition_probes,
)
CHAINS = Kind(
  "chains",
  chains,
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
  split_names=_chains_splits,
  column_shapes=lambda params: {
    "inputs": (params["max_hops"] + 1,),
    "target": (),
    "bridges": (params["max_hops"] - 1,),
  },
  longest=lambda data_cfg: data_cfg.max_hops,
  train_split=_chains_train,
  probes=_chains_probes,
)
KINDS = {k.name: k for k in (COMPOSITION, CHAINS)}
