"""The knowledge-graph tasks' generators (data/kg.py's `composition` and
`chains`): int arrays, everything derived from one seed. They return the
splits as plain arrays; data/kg.py wraps them in its types (`vocab` is its
`Vocab`), so this module imports nothing of it."""

import numpy as np

from loopjax.errors import ConfigError

Split = dict[str, np.ndarray]


def composition(
  *,
  vocab,
  num_entities: int,
  num_relations: int,
  out_degree: int,
  ood_ratio: float,
  p_test_id: float,
  phi: float,
  probe_size: int,
  seed: int,
) -> dict[str, Split]:
  """Generates the 2-hop composition task; same arguments, same arrays."""
  E, R, D = num_entities, num_relations, out_degree
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
  return {
    name: _examples(hop1, hop2, rel_A, tail_A, D, vocab)
    for name, (hop1, hop2) in pairs.items()
  }


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


def chains(
  *,
  vocab,
  num_entities: int,
  num_relations: int,
  max_hops: int,
  train_per_hop: int,
  test_per_hop: int,
  seed: int,
  val_per_hop: int = 0,
) -> dict[str, Split]:
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
  return splits


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


def _chain_examples(h_N, rels_Nk, tail_RE, K: int, vocab) -> Split:
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
