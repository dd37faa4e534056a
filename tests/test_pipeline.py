"""grain pipeline: epochs cover the data, atomic upsampling, resumable state."""

import collections

import numpy as np
import pytest

from loopjax.data import pipeline

PAD = 9


def split(n_atomic=6, n_inferred=10):
  n = n_atomic + n_inferred
  inputs = np.arange(3 * n, dtype=np.int32).reshape(n, 3) % PAD
  inputs[:n_atomic, 2] = PAD
  return {
    "inputs": inputs,
    "target": np.arange(n, dtype=np.int32),
    "bridge": np.r_[np.full(n_atomic, -1), np.zeros(n_inferred)].astype(np.int32),
  }


@pytest.mark.parametrize("repeat", [1, 3])
def test_an_epoch_holds_each_example_once_and_atomic_facts_repeat_times(repeat):
  s = split()
  epoch = 16 + 6 * (repeat - 1)
  it = pipeline.train_iterator(
    s, batch_size=2, seed=0, pad_id=PAD, atomic_repeat=repeat
  )
  seen = collections.Counter(
    int(t) for _ in range(epoch // 2) for t in next(it)["target"]
  )
  assert seen == {i: repeat if i < 6 else 1 for i in range(16)}


def test_answer_position_is_the_last_real_token():
  b = next(pipeline.train_iterator(split(), 16, 0, PAD))
  np.testing.assert_array_equal(b["answer_pos"], np.where(b["target"] < 6, 1, 2))
  np.testing.assert_array_equal(b["hops"], b["answer_pos"])


def test_with_pad_to_the_answer_is_read_at_a_fixed_pad_column():
  """LTG's layout: every example padded to pad_to tokens, read at the last
  column (a pad); `hops` still counts the real tokens."""
  b = next(pipeline.train_iterator(split(), 16, 0, PAD, pad_to=7))
  real = b["inputs"][:, :3]
  assert b["inputs"].shape == (16, 7) and np.all(b["inputs"][:, 3:] == PAD)
  np.testing.assert_array_equal(real, split()["inputs"][b["target"]])
  assert set(b["answer_pos"]) == {6}
  np.testing.assert_array_equal(b["hops"], np.where(b["target"] < 6, 1, 2))
  (e,) = pipeline.eval_batches(split(), 16, PAD, pad_to=7)
  assert e["inputs"].shape == (16, 7) and set(e["answer_pos"]) == {6}


def test_restored_state_continues_the_same_stream():
  it = pipeline.train_iterator(split(), 4, seed=1, pad_id=PAD)
  for _ in range(5):
    next(it)
  state = it.get_state()
  expected = [next(it)["target"] for _ in range(7)]
  it2 = pipeline.train_iterator(split(), 4, seed=1, pad_id=PAD)
  it2.set_state(state)
  for want in expected:
    np.testing.assert_array_equal(next(it2)["target"], want)
