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

import numpy as np

from loopjax.errors import ConfigError

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
  if task == "composition":
    return SPLITS
  ks = range(2, params["max_hops"] + 1)
  kinds = ("train", "test", "val") if params.get("val_per_hop") else ("train", "test")
  return ("atomic", *(f"{s}_k{k}" for k in ks for s in kinds))


def column_shapes(task: str, params: dict) -> dict[str, tuple[int, ...]]:
  """Each column's per-example shape (all int32)."""
  if task == "composition":
    return {"inputs": (3,), "target": (), "bridge": ()}
  K = params["max_hops"]
  return {"inputs": (K + 1,), "target": (), "bridges": (K - 1,)}


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
  K = data_cfg.max_hops if data_cfg.task == "chains" else 2
  empty = {"inputs": np.zeros((0, K + 1), np.int32), "target": np.zeros(0, np.int32)}
  vocab = Vocab(data_cfg.num_entities, data_cfg.num_relations)
  return TaskData(vocab, {"train": empty}, data_cfg.task, data_cfg.pad_to)


def train_split(data: TaskData, max_hops: int) -> Split:
  """What training samples from: composition's `train`; for chains, the atomic
  facts and the train chains of up to `max_hops` hops (a curriculum stage),
  padded to max_hops + 1 tokens only (compute grows with length)."""
  if data.task == "composition":
    return data.splits["train"]
  names = ["atomic"] + [f"train_k{k}" for k in range(2, max_hops + 1)]
  return {
    "inputs": np.concatenate([data.splits[n]["inputs"] for n in names])[
      :, : max_hops + 1
    ],
    "target": np.concatenate([data.splits[n]["target"] for n in names]),
  }


def probes(data: TaskData, train_hops: int = 0, size: int = 0) -> dict[str, Split]:
  """The splits evaluations report, none empty. Composition: every split but
  `train`. Chains: every `test_k<k>`; each `val_k<k>` with k <= train_hops
  (what halting thresholds are tuned on: trained depths only, never the test
  chains); samples of `size` (fixed, the first after a seeded shuffle) from
  the atomic facts and from each `train_k<k>` with k <= train_hops
  (memorization)."""
  if data.task == "composition":
    names = [n for n in data.splits if n != "train"]
    return {n: data.splits[n] for n in names if len(data.splits[n]["target"])}
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
  return {n: s for n, s in out.items() if len(s["target"])}


def composition(
  *,
  num_entities: int,
  num_relations: int,
  out_degree: int,
  ood_ratio: float,
  p_test_id: float,
  phi: float,
  probe_size: int,
  seed: int,
) -> TaskData:
  """Generates the 2-hop composition task; same arguments, same arrays."""
  E, R, D = num_entities, num_relations, out_degree
  vocab = Vocab(E, R)
  rng = np.random.default_rng(seed)
  # Atomic fact a = h * D + i is (h, rel_A[a]) -> tail_A[a].
  rel_A = (E + np.argsort(rng.random((E, R)), axis=1)[:, :D]).ravel()
  tail_A = rng.integers(0, E, E * D)
  ood_A = np.zeros(E * D, bool)
  ood_A[rng.choice(E * D, round(ood_ratio * E * D), replace=False)] = True

  # Chain c = a1 * D + j follows a1 with the j-th fact of its tail entity.
  hop1_C = np.repeat(np.arange(E * D), D)
  hop2_C = (tail_A[:, None] * D + np.arange(D)).ravel()
  ood1_C, ood2_C = ood_A[hop1_C], ood_A[hop2_C]
  both_id_C = ~ood1_C & ~ood2_C
  held_out_C = rng.random(len(hop1_C)) < p_test_id
  pool_ood = np.flatnonzero(ood1_C & ood2_C)
  pool_test_id = np.flatnonzero(both_id_C & held_out_C)
  pool_train = np.flatnonzero(both_id_C & ~held_out_C)

  atomic_id, atomic_ood = np.flatnonzero(~ood_A), np.flatnonzero(ood_A)
  wanted = phi * len(atomic_id)  # compared as a float: a huge phi overflows round()
  if wanted >= len(pool_train) + 0.5:
    raise ConfigError(
      f"data.phi: {phi} asks for {wanted:.6g} inferred training facts but only "
      f"{len(pool_train)} exist; use at most {len(pool_train) / len(atomic_id):.6g}"
    )
  train_inferred = rng.choice(pool_train, round(wanted), replace=False)

  no_hop = np.full(E * D, -1)
  train = _shuffle(
    rng,
    (
      np.concatenate([np.arange(E * D), hop1_C[train_inferred]]),
      np.concatenate([no_hop, hop2_C[train_inferred]]),
    ),
  )
  probes = {
    "id_atomic": (atomic_id, no_hop[atomic_id]),
    "ood_atomic": (atomic_ood, no_hop[atomic_ood]),
    "train_inferred": (hop1_C[train_inferred], hop2_C[train_inferred]),
    "test_inferred_id": (hop1_C[pool_test_id], hop2_C[pool_test_id]),
    "test_inferred_ood": (hop1_C[pool_ood], hop2_C[pool_ood]),
  }
  pairs = {"train": train} | {
    name: _sample(rng, pair, probe_size) for name, pair in probes.items()
  }
  return TaskData(
    vocab,
    {
      name: _examples(hop1, hop2, rel_A, tail_A, D, vocab)
      for name, (hop1, hop2) in pairs.items()
    },
    "composition",
  )


def _shuffle(rng, pair):
  order = rng.permutation(len(pair[0]))
  return pair[0][order], pair[1][order]


def _sample(rng, pair, size):
  keep = rng.choice(len(pair[0]), min(size, len(pair[0])), replace=False)
  return pair[0][keep], pair[1][keep]


def _examples(hop1_N, hop2_N, rel_A, tail_A, D, vocab) -> Split:
  """Facts as atomic-fact indices (hop2 = -1 for an atomic fact) -> token arrays."""
  atomic_N = hop2_N < 0
  last_N = np.where(atomic_N, hop1_N, hop2_N)
  inputs_N3 = np.stack(
    [hop1_N // D, rel_A[hop1_N], np.where(atomic_N, vocab.pad_id, rel_A[last_N])],
    axis=1,
  )
  return {
    "inputs": inputs_N3.astype(np.int32),
    "target": tail_A[last_N].astype(np.int32),
    "bridge": np.where(atomic_N, -1, tail_A[hop1_N]).astype(np.int32),
  }


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


def chains(
  *,
  num_entities: int,
  num_relations: int,
  max_hops: int,
  train_per_hop: int,
  test_per_hop: int,
  seed: int,
  val_per_hop: int = 0,
) -> TaskData:
  """k-hop chains (LTG's depth extrapolation) as int arrays, the same for the same
  arguments.

  Every relation is a random permutation of the entities, so each hop is a
  bijection and every (h, r1..rk) has exactly one answer. Splits: "atomic" (all
  E x R facts, in training) and, per k = 2..max_hops, unique chains split into
  "train_k<k>" and "test_k<k>" and, with `val_per_hop`, "val_k<k>" (all
  three disjoint; the validation chains drawn after the others from their own
  stream, so adding them leaves train and test as they were). "inputs"
  (N, max_hops + 1): [h, r1..rk, pad...], the answer read at the last real
  token (position k); "bridges" (N, max_hops - 1): the intermediate entities
  b_1..b_{k-1}, -1 after them.
  """
  E, R, K = num_entities, num_relations, max_hops
  vocab = Vocab(E, R)
  rng = np.random.default_rng(seed)
  tail_RE = np.argsort(rng.random((R, E)), axis=1)  # tail_RE[r, h]: r(h)
  h_A, r_A = np.divmod(np.arange(E * R), R)
  splits = {"atomic": _chain_examples(h_A, r_A[:, None], tail_RE, K, vocab)}
  val_rng = np.random.default_rng([seed, 1])  # its own stream: train, test as ever
  for k in range(2, K + 1):
    n = train_per_hop + test_per_hop
    if n + val_per_hop > E * R**k:  # Python ints: no overflow for long chains
      raise ConfigError(
        f"data.train_per_hop: {k}-hop chains number {E * R**k}; "
        f"{n} train + test"
        + (f" + {val_per_hop} val" if val_per_hop else "")
        + " asked for"
      )
    walks = _unique_walks(rng, E, R, k, n)
    ex = _chain_examples(walks[:, 0], walks[:, 1:], tail_RE, K, vocab)
    splits[f"train_k{k}"] = {name: a[:train_per_hop] for name, a in ex.items()}
    splits[f"test_k{k}"] = {name: a[train_per_hop:] for name, a in ex.items()}
    if val_per_hop:
      val_walks = _unique_walks(val_rng, E, R, k, val_per_hop, taken=walks)
      splits[f"val_k{k}"] = _chain_examples(
        val_walks[:, 0], val_walks[:, 1:], tail_RE, K, vocab
      )
  return TaskData(vocab, splits, "chains")


def _unique_walks(rng, E: int, R: int, k: int, n: int, taken=None):
  """n distinct (h, r1..rk), uniformly at random and none of `taken`'s rows,
  as rows (n, k + 1)."""
  rows = np.zeros((0, k + 1), np.int64) if taken is None else taken.astype(np.int64)
  first_new, want = len(rows), len(rows) + n
  while len(rows) < want:
    m = 2 * (want - len(rows)) + 16
    more = np.concatenate(
      [rng.integers(0, E, (m, 1)), rng.integers(0, R, (m, k))], axis=1
    )
    rows = np.concatenate([rows, more])
    _, first = np.unique(rows, axis=0, return_index=True)
    rows = rows[np.sort(first)]  # first occurrences in draw order: deterministic
  return rows[first_new:want]


def _chain_examples(h_N, rels_Nk, tail_RE, K: int, vocab: Vocab) -> Split:
  N, k = rels_Nk.shape
  walk = [h_N]
  for j in range(k):
    walk.append(tail_RE[rels_Nk[:, j], walk[-1]])
  inputs = np.full((N, K + 1), vocab.pad_id)
  inputs[:, 0] = h_N
  inputs[:, 1 : k + 1] = vocab.num_entities + rels_Nk
  bridges = np.full((N, max(K - 1, 0)), -1)
  if k > 1:
    bridges[:, : k - 1] = np.stack(walk[1:k], 1)
  return {
    "inputs": inputs.astype(np.int32),
    "target": walk[-1].astype(np.int32),
    "bridges": bridges.astype(np.int32),
  }
