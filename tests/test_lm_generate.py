"""Batched generation: prompts of different lengths in one batch, stop
conditions, per-token exits with the cache of each token's last iteration."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import lm as lm_experiment
from loopjax.halting import Rule
from loopjax.lm.generate import generate, left_pad
from loopjax.state import Model, build_model

V, T = 64, 40
PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 2, 4], [11, 12, 13, 14, 15]]


def model(**overrides):
  c = lm_experiment.get_config("tiny").model
  c.update(d_model=32, num_heads=4, num_loops=4, **overrides)
  m = build_model(c, V, T, seed=0)
  return m, Model(nnx.graphdef(m), nnx.to_pure_dict(nnx.state(m, nnx.Param)))


def test_left_padding_right_aligns_each_prompt():
  tokens_BT, start_B = left_pad(PROMPTS, pad_id=0)
  assert tokens_BT.shape == (3, 7) and list(start_B) == [4, 0, 2]
  assert list(tokens_BT[0]) == [0, 0, 0, 0, 5, 9, 2]
  with pytest.raises(ValueError, match="empty prompt"):
    left_pad([[1], []])


@pytest.mark.parametrize(
  "overrides",
  [
    dict(),
    pytest.param(  # ~8 s
      dict(pos_encoding="learned", num_prelude=1, num_coda=1), marks=pytest.mark.slow
    ),
  ],
)
def test_a_ragged_batch_generates_what_each_prompt_generates_alone(overrides):
  """Rotary and learned positions count from each row's first real token, and
  the padding is never attended to: every row's tokens and logits are those
  of its prompt alone (then, there is no padding)."""
  _, mod = model(**overrides)
  batch = generate(mod, PROMPTS, 6, num_loops=3, keep_logits=True)
  for b, p in enumerate(PROMPTS):
    alone = generate(mod, [p], 6, num_loops=3, keep_logits=True)
    assert batch.tokens[b] == alone.tokens[0]
    np.testing.assert_allclose(batch.logits[b], alone.logits[0], atol=2e-4)


def test_a_row_ends_at_eos_or_its_stop_condition_and_the_batch_when_all_have():
  _, mod = model()
  free = generate(mod, PROMPTS, 8, num_loops=3)
  eos = free.tokens[0][2]  # row 0's third token
  stop_at = free.tokens[1][:4]  # row 1 ends once its first 4 tokens are out
  out = generate(
    mod, PROMPTS, 8, num_loops=3, eos_id=eos, stop=lambda new: new[:4] == stop_at
  )

  def ended(row, limit=8):
    return 1 + row.index(eos) if eos in row[:limit] else limit

  assert (
    out.tokens[0] == free.tokens[0][: ended(free.tokens[0])] and eos in out.tokens[0]
  )
  assert out.tokens[1] == free.tokens[1][: ended(free.tokens[1], 4)]
  assert out.tokens[2] == free.tokens[2][: ended(free.tokens[2])]
  everything_ended = generate(mod, PROMPTS, 8, num_loops=3, stop=lambda new: True)
  assert [len(t) for t in everything_ended.tokens] == [1, 1, 1]
  assert everything_ended.iterations.shape == (3, 1)


def test_exiting_never_is_decoding_at_every_recurrence():
  _, mod = model()
  fixed = generate(mod, PROMPTS, 5, num_loops=4, exit=Rule("fixed"), keep_logits=True)
  plain = generate(mod, PROMPTS, 5, num_loops=4, keep_logits=True)
  assert fixed.tokens == plain.tokens and (fixed.iterations == 4).all()
  np.testing.assert_allclose(fixed.logits, plain.logits, atol=2e-4)


def test_tokens_that_exit_at_r_see_the_model_run_r_times():
  """Every new token exits at iteration 2 (entropy < inf from r_min 2): after
  the first (chosen from the prompt's R), each token's logits are the full
  forward's at 2 recurrences, since iterations 1-2 of the prompt's cache do
  not depend on the later ones; the iterations recorded are 2."""
  m, mod = model(injection="add")
  rule = Rule("entropy", tau=float("inf"), r_min=2)
  out = generate(mod, PROMPTS[1:2], 5, num_loops=4, exit=rule, keep_logits=True)
  assert list(out.iterations[0]) == [4, 2, 2, 2, 2]
  text = jnp.asarray([PROMPTS[1] + out.tokens[0]])
  at2 = np.asarray(m(text, None, num_loops=2))[0]
  np.testing.assert_allclose(out.logits[0, 1:], at2[7:11], atol=2e-4)


def test_rows_exit_independently_of_the_rest_of_the_batch():
  """Huginn's KL rule at a threshold where tokens exit at different
  iterations: each row's tokens and iterations are its own prompt's alone."""
  _, mod = model(injection="add")
  rule = Rule("kl_reverse", eps=1e-4, start="uniform")
  batch = generate(mod, PROMPTS, 6, num_loops=4, exit=rule)
  used = set(batch.iterations[:, 1:].ravel().tolist())
  assert len(used) > 1, f"the rule should exit at several depths, got {used}"
  for b, p in enumerate(PROMPTS):
    alone = generate(mod, [p], 6, num_loops=4, exit=rule)
    assert batch.tokens[b] == alone.tokens[0]
    np.testing.assert_array_equal(batch.iterations[b], alone.iterations[0])


def test_a_bounded_cache_keeps_iteration_r_in_slot_r_mod_m():
  """M = R slots is the full cache; M = 2 of R = 4 holds half the memory and
  decodes other logits (iterations 3, 4 read the prompt's 1, 2 overwritten);
  with a core that leaves the state as it is (zero-init output projections,
  no injection: every iteration's keys and values equal), bounding the cache
  changes nothing."""
  _, mod = model(injection="add")
  full = generate(mod, PROMPTS, 4, num_loops=4, keep_logits=True)
  same = generate(mod, PROMPTS, 4, num_loops=4, cache_slots=4, keep_logits=True)
  half = generate(mod, PROMPTS, 4, num_loops=4, cache_slots=2, keep_logits=True)
  np.testing.assert_allclose(same.logits, full.logits, atol=1e-6)
  np.testing.assert_allclose(half.logits[:, 0], full.logits[:, 0], atol=2e-4)
  assert not np.allclose(half.logits[:, 1:], full.logits[:, 1:], atol=1e-3)
  _, still = model(injection="none", out_init_scale=0.0)
  a = generate(still, PROMPTS, 4, num_loops=4, keep_logits=True)
  b = generate(still, PROMPTS, 4, num_loops=4, cache_slots=1, keep_logits=True)
  np.testing.assert_allclose(a.logits, b.logits, atol=1e-5)
  with pytest.raises(ValueError, match="cache_slots"):
    generate(mod, PROMPTS, 2, num_loops=4, cache_slots=5)


def test_the_default_new_tokens_fit_the_models_positions():
  """A 128-position learned-position model given a 2-token prompt: 127 new
  tokens, not 128 (the last is never fed back); RoPE reaches 4x its context."""
  from loopjax.lm import sample

  assert sample.default_new_tokens(2, 128, "learned") == 127
  assert sample.default_new_tokens(2, 128, "rope") == 128
  assert sample.default_new_tokens(200, 128, "learned") == 1  # then refused
  for prompt in (1, 2, 64, 128):
    new = sample.default_new_tokens(prompt, 128, "learned")
    sample._check_length(prompt, new, 128, "learned")  # never refused
