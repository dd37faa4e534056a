"""grain pipelines over in-memory columns.

The TFDS array_record files are read once into numpy columns (a knowledge-graph
split is a few MB); grain then shuffles and batches *indices*, and a batch is one
vectorized gather. The iterator's state (`get_state`/`set_state`) is saved in
checkpoints, so a resumed run sees exactly the batches it would have seen.
"""

import functools

import grain
import jax
import numpy as np

from loopjax import sharding
from loopjax.errors import ConfigError


def answer_pos(inputs_BT: np.ndarray, pad_id: int) -> np.ndarray:
  """Position of the last real token: a chain's hop count k (1 for an atomic
  fact), where the answer is predicted unless `pad_to` says otherwise."""
  return ((inputs_BT != pad_id).sum(-1) - 1).astype(np.int32)


def _gather(split, idx_B, pad_id, pad_to: int = 0):
  """A batch: inputs, target, `hops` (the last real token's position) and
  `answer_pos`, where the answer is read: that position, or with `pad_to` the
  last of `pad_to` columns (inputs padded to them)."""
  inputs_BT = split["inputs"][idx_B]
  hops_B = answer_pos(inputs_BT, pad_id)
  if pad_to:
    inputs_BT = np.pad(
      inputs_BT, ((0, 0), (0, pad_to - inputs_BT.shape[1])), constant_values=pad_id
    )
  return {
    "inputs": inputs_BT,
    "target": split["target"][idx_B],
    "answer_pos": np.full_like(hops_B, pad_to - 1) if pad_to else hops_B,
    "hops": hops_B,
  }


def train_iterator(
  split,
  batch_size: int,
  seed: int,
  pad_id: int,
  atomic_repeat: int = 1,
  shard: tuple[int, int] = (0, 1),
  pad_to: int = 0,
):
  """Endless shuffled batches of group `shard[0]` of `shard[1]`: the rows of
  each global batch one group of processes feeds (a new order each epoch);
  processes holding the same rows of the mesh are one group
  (`sharding.row_groups`).

  An element of the grain dataset is a whole batch: epoch e's permutation is
  drawn once (seeded by (seed, e)) and batch j is one slice and one gather, so a
  batch costs microseconds instead of a Python call per example (12-24 ms per
  batch of 256 with element-wise shuffle + batch). The last partial batch of an
  epoch is dropped. `atomic_repeat` > 1 puts every atomic fact (bridge -1) that
  many times in each epoch: OOD atomic facts are otherwise ~1% of the stream.
  `pad_to`: see `_gather`.
  """
  atomic = np.flatnonzero(answer_pos(split["inputs"], pad_id) == 1)
  rows = np.concatenate(
    [np.arange(len(split["target"]))] + [atomic] * (atomic_repeat - 1)
  )
  return shuffled_batches(
    rows, batch_size, seed, lambda idx_B: _gather(split, idx_B, pad_id, pad_to), shard
  )


def shuffled_batches(rows, batch_size: int, seed: int, gather, shard=(0, 1)):
  """Endless batches `gather(rows[...])` of group `shard[0]` of `shard[1]`
  (every group's examples its own: rows[group::groups]), in a new seeded order
  each epoch; a grain iterator with get_state/set_state."""
  i_proc, n_proc = shard
  B = batch_size // n_proc  # sharding.process_rows checked the division
  epoch = rows[i_proc::n_proc]
  per_epoch = len(epoch) // B
  if per_epoch == 0:
    raise ConfigError(
      f"train.batch_size: must be at most the training set's "
      f"size per process ({len(epoch)}); got {batch_size}"
    )

  @functools.lru_cache(maxsize=2)
  def order(e: int):
    return epoch[np.random.default_rng([seed, e]).permutation(len(epoch))]

  def batch(i, _):
    j = i % per_epoch
    return gather(order(i // per_epoch)[j * B : (j + 1) * B])

  ds = grain.MapDataset.range(per_epoch).repeat().map_with_index(batch)
  return iter(ds.to_iter_dataset())


def eval_batches(split, batch_size: int, pad_id: int, columns=(), pad_to: int = 0):
  """Fixed-size batches covering the split once (one compiled shape), with the
  split's `columns` (e.g. "bridge") besides the model's inputs; the last is
  padded with example 0, whose results callers drop (the first n rows count)."""
  n = len(split["target"])
  for start in range(0, n, batch_size):
    idx_B = np.arange(start, start + batch_size)
    idx_B = np.where(idx_B < n, idx_B, 0)
    yield _gather(split, idx_B, pad_id, pad_to) | {c: split[c][idx_B] for c in columns}


def map_batches(
  fn,
  split,
  batch_size: int,
  pad_id: int,
  *,
  axis=0,
  columns=(),
  pad_to: int = 0,
  put=lambda batch: batch,
):
  """`fn(put(batch))` over `eval_batches`: its outputs (a pytree of arrays
  whose `axis` runs over the batch) concatenated on the host, padding cut.
  `put`: where each batch goes (`sharding.Feed.put`); outputs split over
  several processes' devices are gathered whole in each."""
  n = len(split["target"])
  outs = sharding.host(  # every batch dispatched before the first is read
    [fn(put(b)) for b in eval_batches(split, batch_size, pad_id, columns, pad_to)]
  )
  return jax.tree.map(
    lambda *o: np.take(np.concatenate(o, axis), np.arange(n), axis), *outs
  )


class StagedIterator:
  """Training batches from the current curriculum stage's split.

  `make(stage)` builds the stage's iterator. The state (saved in checkpoints)
  holds the stage with the position, so a resumed run rebuilds the right split
  before seeking in it.
  """

  def __init__(self, make, stage: int):
    self._make = make
    self.set_stage(stage)

  def set_stage(self, stage: int) -> None:
    self.stage, self._it = int(stage), self._make(int(stage))

  def __iter__(self):
    return self

  def __next__(self):
    return next(self._it)

  def get_state(self) -> dict:
    return {"stage": self.stage, "position": self._it.get_state()}

  def set_state(self, state: dict) -> None:
    self.set_stage(state["stage"])
    self._it.set_state(state["position"])
