"""The `paper` variants are the official LTG recipes, and their options work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model import V, inputs, model_cfg

from experiments import extrapolation, sysgen
from loopjax import config as config_lib
from loopjax import train, workdir
from loopjax.kg import curriculum
from loopjax.state import build_model, make_optimizer, train_state


def _fields(c, **want):
  for path, value in want.items():
    node = c
    for k in path.split("__"):
      node = node[k]
    assert node == value, path


def test_systematicity_paper_is_ltgs_train_systematicity():
  c = sysgen.get_config("paper")
  config_lib.validate(c)
  _fields(
    c,
    data__num_entities=2000,
    data__num_relations=200,
    data__out_degree=20,
    data__ood_ratio=0.05,
    data__phi=7.2,
    model__d_model=768,
    model__num_heads=12,
    model__num_layers=4,
    model__num_loops=4,
    model__pos_encoding="learned",
    model__injection="none",
    model__norm_position="pre",
    model__norm_type="layernorm",
    model__tie_embeddings=True,
    model__embed_init_std=1.0,
    model__init_std=0.02,
    model__out_init_scale=1.0,
    model__dtype="bfloat16",
    train__batch_size=128,
    train__lr=1e-4,
    train__warmup_steps=2000,
    train__schedule="constant",
    train__b1=0.9,
    train__b2=0.999,
    train__eps=1e-8,
    train__weight_decay=0.1,
    train__decay="all",
    train__grad_clip=0.0,
    train__label_smoothing=0.1,
    train__supervise="last",
  )
  assert c.train.depth.dist == "fixed"


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v}
  return out


def test_systematicity_paper_cpu_is_ltgs_recipe_at_one_core_size():
  """`paper_cpu` differs from `paper` in size, lr and length only: a change
  to LTG's block, optimizer or loss reaches both or neither."""
  paper, small = (_flat(sysgen.get_config(v).to_dict()) for v in ("paper", "paper_cpu"))
  config_lib.validate(sysgen.get_config("paper_cpu"))
  differ = {k for k in paper if paper[k] != small[k]}
  assert differ == {
    "variant",
    "data.num_entities",
    "data.num_relations",
    "data.p_test_id",
    "data.probe_size",
    "model.d_model",
    "model.num_heads",
    "model.num_layers",
    "model.dtype",
    "train.num_steps",
    "train.lr",
    "checkpoint.every",
    "checkpoint.keep_every",
    "eval_every",
  }


def test_extrapolation_long_is_the_cpu_recipe_larger_and_longer():
  """`long` differs from `cpu` in model size, positions, depth range,
  schedule (and its decay per stage) and length only, and it resumes a run
  started as `cpu` with those flags (the variant's name is no conflict)."""
  cpu, long = (extrapolation.get_config(v) for v in ("cpu", "long"))
  config_lib.validate(long)
  flat_cpu, flat_long = _flat(cpu.to_dict()), _flat(long.to_dict())
  assert {k for k in flat_cpu if flat_cpu[k] != flat_long[k]} == {
    "variant",
    "model.d_model",
    "model.num_heads",
    "model.num_layers",
    "model.random_positions",
    "train.depth.max",
    "train.num_steps",
    "train.schedule",
    "train.decay_steps",
    "train.curriculum.lr_decay",
    "eval.depths",
    "checkpoint.keep_every",
    "eval_every",
  }
  # the long runs' command line: `cpu` and flags
  cpu.model.update(d_model=128, num_heads=8, num_layers=2, random_positions=64)
  cpu.train.depth.max = 12
  cpu.train.update(num_steps=500_000, schedule="cosine", decay_steps=150_000)
  cpu.train.curriculum.lr_decay = 0.7
  cpu.update(eval_every=2000)
  cpu.eval.depths, cpu.checkpoint.keep_every = (8, 10, 12, 16, 24), 10_000
  assert workdir.conflicts(cpu.to_dict(), long.to_dict()) == []
  assert _flat(cpu.to_dict()) == flat_long | {"variant": "cpu"}


def test_extrapolation_paper_is_ltgs_train_extrapolation():
  c = extrapolation.get_config("paper")
  config_lib.validate(c)
  _fields(
    c,
    data__task="chains",
    data__num_entities=200,
    data__num_relations=10,
    data__max_hops=40,
    data__train_hops=40,
    data__train_per_hop=15_000,
    data__test_per_hop=750,
    model__d_model=768,
    model__num_heads=12,
    model__num_layers=4,
    model__pos_encoding="none",
    model__injection="none",
    model__out_init_scale=0.0,
    model__embed_init_std=1.0,
    model__init_std=0.02,
    model__dtype="bfloat16",
    train__batch_size=128,
    train__lr=1e-4,
    train__warmup_steps=2000,
    train__schedule="constant",
    train__b2=0.999,
    train__eps=1e-8,
    train__weight_decay=0.01,
    train__decay="all",
    train__grad_clip=0.0,
    train__label_smoothing=0.0,
    train__supervise="last",
    train__depth__dist="poisson",
    train__depth__mean=4.0,
    train__depth__min=2,
    train__depth__max=8,
    train__curriculum__enabled=True,
    train__curriculum__start=2,
    train__curriculum__threshold=0.95,
    train__curriculum__strict=True,
    train__curriculum__reset_optimizer=True,
  )


def test_zero_output_projections_make_every_block_the_identity():
  model = build_model(model_cfg(out_init_scale=0.0, num_prelude=1), V, 5, seed=0)
  for block in [*model.prelude, *model.core]:
    assert not np.any(block.attn.wo[...]) and not np.any(block.mlp.w2[...])
  x = jax.random.normal(jax.random.key(0), (2, 5, 16))
  np.testing.assert_array_equal(model.core[0](x), x)


def test_embedding_init_std_is_its_own():
  model = build_model(model_cfg(embed_init_std=1.0, init_std=0.02), 4000, 5, seed=0)
  assert abs(float(jnp.std(model.embed[...])) - 1.0) < 0.02
  assert abs(float(jnp.std(model.core[0].mlp.w1[...])) - 0.02) < 0.002


def test_ltgs_input_injection_is_add_from_zeros():
  """LTG adds the embeddings before every iteration after the first: with
  injection add from a zero state, iteration 1 sees exactly x."""
  model = build_model(model_cfg(injection="add", init_state="zeros"), V, 5, seed=0)
  tokens_BT, pos_B = inputs()
  x = model.embed_tokens(tokens_BT)
  h = x
  for r in range(3):
    if r > 0:
      h = h + x
    for block in model.core:
      h = block(h)
  want = model.logits(jnp.take_along_axis(h, pos_B[:, None, None], 1)[:, 0])
  np.testing.assert_allclose(model(tokens_BT, pos_B), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("decay", ["matrices", "all"])
def test_weight_decay_on_matrices_or_every_parameter(decay):
  c = sysgen.get_config("tiny")
  c.train.update(decay=decay, weight_decay=0.5, lr=0.1, warmup_steps=0, grad_clip=0.0)
  params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
  tx = make_optimizer(c.train)
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero, tx.init(params), params)  # no gradient: decay only
  assert float(updates["w"][0, 0]) < 0
  assert (float(updates["b"][0]) < 0) == (decay == "all")


def test_strict_threshold_needs_more_than_it():
  c = extrapolation.get_config("tiny")
  c.train.curriculum.threshold = 0.95
  at = {"eval/test_k2/acc": 0.95}
  assert curriculum.next_stage(c, 2, at) == 3
  c.train.curriculum.strict = True
  assert curriculum.next_stage(c, 2, at) is None
  assert curriculum.next_stage(c, 2, {"eval/test_k2/acc": 0.951}) == 3


def test_a_fresh_optimizer_per_stage_warms_up_again():
  """The schedule counts the optimizer's own steps: a stage's fresh state
  starts the warmup over (lr 0 at its first step)."""
  from loopjax.data import kg, pipeline

  c = extrapolation.get_config("tiny")
  c.train.curriculum.reset_optimizer = True
  task = kg.chains(
    num_entities=16,
    num_relations=4,
    max_hops=5,
    train_per_hop=50,
    test_per_hop=8,
    seed=0,
  )
  graphdef, state, tx = train_state(c, task)
  step = train.make_train_step(c, graphdef, tx)
  batch = next(
    pipeline.train_iterator(kg.train_split(task, 4), 32, 0, task.vocab.pad_id)
  )
  for _ in range(c.train.warmup_steps + 1):
    state, _ = step(state, batch)
  state = curriculum.enter(state, 3, tx, c)
  new, _ = step(jax.tree.map(jnp.copy, state), batch)
  old, now = jax.tree.leaves(state["params"]), jax.tree.leaves(new["params"])
  for a, b in zip(old, now, strict=True):
    np.testing.assert_array_equal(a, b)  # lr 0 at the warmup's first step
