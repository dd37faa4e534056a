"""A looped LM's run started from a pretrained feedforward model
(`model.init_from=hf:DIR`, retrofitted recurrence): the looped model at step
0, training, resuming, and bad input refused in one line before anything
compiles; on the tiny checkpoints of tests/fixtures/hf."""

import json
import random
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from experiments import lm
from loopjax import config as config_lib
from loopjax import sharding, train
from loopjax.data import lm as lm_data
from loopjax.errors import ConfigError
from loopjax.lm import task as lm_task
from loopjax.loss import lm_loss_fn
from loopjax.pretrained import init_from
from loopjax.pretrained.load import load
from loopjax.state import Model, sharded_train_state
from tests.conftest import cli, in_process, losses

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def word_corpus(root: Path, docs: int = 12) -> Path:
  """Documents of sentences in the fixtures' words (their tokenizer's
  vocabulary less its specials), every sentence a pattern to learn."""
  vocab = json.loads((FIXTURES / "llama_gqa" / "tokenizer.json").read_text())
  words = [w for w in vocab["model"]["vocab"] if not w.startswith("<")]
  rng = random.Random(0)
  root.mkdir(parents=True)
  for i in range(docs):
    lines = [
      f"{rng.choice(words)} has {n} {rng.choice(words)} and gives {n} ."
      for n in rng.choices(("two", "three", "four", "ten"), k=30)
    ]
    (root / f"doc{i:02d}.txt").write_text("\n".join(lines))
  return root


def config(tmp_path, directory=FIXTURES / "llama_gqa", **model):
  c = lm.get_config("retrofit_tiny")
  c.model.update(init_from=f"hf:{directory}", **model)
  corpus = tmp_path / "corpus"
  if not corpus.exists():
    word_corpus(corpus)
  c.data.update(
    source=f"text:{corpus}/*.txt", data_dir=str(tmp_path / "data"), valid_fraction=0.2
  )
  config_lib.validate(c)
  return c


@pytest.mark.parametrize(
  "fixture", ["llama_gqa", pytest.param("olmo2", marks=pytest.mark.slow)]
)
def test_at_step_0_the_looped_model_is_the_pretrained_one_at_any_depth(
  tmp_path, fixture
):
  """The adapter at [0 | I] hands every iteration the prelude's output: the
  split model computes the feedforward one at R = 1 and at R = 3, from a
  random first state; the params sit where the sharding rules put them."""
  c = init_from.resolve(config(tmp_path, FIXTURES / fixture))
  assert (c.model.num_prelude, c.model.num_layers, c.model.num_coda) == (1, 1, 1)
  assert c.model.injection == "concat" and c.model.init_state == "trunc_normal"
  task = lm_data.without_streams(c.data, Path(c.data.tokenizer).read_text())
  c.mesh.update(data=2, fsdp=2, tensor=2, devices=0)
  mesh = sharding.make_mesh(c.mesh)
  given = jax.device_get(init_from.params(c))
  graphdef, state, _, shardings = sharded_train_state(
    c, task, mesh, params=init_from.params(c, mesh)
  )
  placed = jax.tree.map(
    lambda x, s: x.sharding == s, state["params"], shardings["params"]
  )
  assert all(jax.tree.leaves(placed))
  assert state["params"]["embed"].sharding.spec == P("tensor", "fsdp")  # vocab, embed
  jax.tree.map(np.testing.assert_array_equal, state["params"], given)
  looped = Model(graphdef, state["params"]).module()
  _, feedforward = load(FIXTURES / fixture, config_lib.base().model)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)))
  want = feedforward.module()(tokens, None)
  for R in (1, 3):
    got = looped(tokens, None, num_loops=R, key=jax.random.key(R))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_run_trains_from_the_pretrained_params_and_records_their_shapes(tmp_path):
  """Its first loss is the feedforward model's on the first batch (whatever
  depth was drawn); then it learns; config.json holds the shapes that trained."""
  c = config(tmp_path)
  last = train.train_and_evaluate(c, tmp_path / "run")
  loss = losses(tmp_path / "run")
  assert all(np.isfinite(v) for v in loss.values()) and loss[8] < loss[1]
  task = lm_task.text(init_from.resolve(c).data)
  batch = next(lm_data.train_iterator(task, c.train.batch_size, c.seed))
  _, feedforward = load(FIXTURES / "llama_gqa", config_lib.base().model)
  first, _ = lm_loss_fn(feedforward.module(), batch, c.train, key=None, num_loops=1)
  np.testing.assert_allclose(loss[1], first, rtol=1e-5)
  assert np.isfinite(last["eval/validation/loss@3"])
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  m, hf = saved["model"], json.loads((FIXTURES / "llama_gqa/config.json").read_text())
  assert (m["d_model"], m["num_heads"], m["num_kv_heads"]) == (32, 4, 2)
  assert (m["mlp_type"], m["mlp_hidden"], m["rope_theta"]) == ("swiglu", 48, 5e5)
  assert (m["num_prelude"], m["num_layers"], m["num_coda"]) == (1, 1, 1)
  assert m["tie_embeddings"] is hf["tie_word_embeddings"] is False
  assert m["injection"] == "concat" and m["num_loops"] == 2  # the run's own
  assert saved["data"]["vocab_size"] == 64
  assert saved["data"]["tokenizer"] == str(FIXTURES / "llama_gqa" / "tokenizer.json")


@pytest.mark.slow
def test_a_resumed_run_restores_its_checkpoint_not_the_pretrained_params(
  tmp_path, capsys
):
  """Stopped at step 4, DIR then missing a tensor (loading it would fail):
  the same command goes on from its checkpoint, bit for bit the run that
  never stopped."""
  directory = tmp_path / "llama"
  shutil.copytree(FIXTURES / "llama_gqa", directory)
  c = config(tmp_path, directory)
  c.train.schedule = "constant"  # a shorter num_steps would change a cosine
  c.eval_every = 0
  train.train_and_evaluate(c, tmp_path / "straight")
  c.train.num_steps = 4
  train.train_and_evaluate(c, tmp_path / "resumed")
  tensors = load_file(directory / "model.safetensors")
  del tensors["lm_head.weight"]
  save_file(tensors, directory / "model.safetensors")
  with pytest.raises(ConfigError, match="tensor lm_head.weight is missing"):
    init_from.params(init_from.resolve(c))
  c.train.num_steps = 8
  capsys.readouterr()
  train.train_and_evaluate(c, tmp_path / "resumed")
  out = capsys.readouterr().out
  assert "resumed from" in out and "started from" not in out
  assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")


def larger_tokenizer(tmp_path) -> Path:
  """llama_gqa with a tokenizer one word more than its 64-row embedding."""
  directory = tmp_path / "llama"
  shutil.copytree(FIXTURES / "llama_gqa", directory)
  tok = json.loads((directory / "tokenizer.json").read_text())
  vocab = tok["model"]["vocab"]
  vocab["extra"] = len(vocab)
  (directory / "tokenizer.json").write_text(json.dumps(tok))
  return directory


@pytest.mark.parametrize(
  "setup, message",
  [
    (
      lambda c, d: c.model.update(init_from=f"hf:{d / 'none'}"),
      "model.init_from: .*none has no config.json$",
    ),
    (
      lambda c, d: c.model.update(init_from=str(FIXTURES / "llama_gqa")),
      "model.init_from: must be '' or 'hf:DIR'",
    ),
    (lambda c, d: c.model.update(hf_split=""), "model.hf_split: required with"),
    (
      lambda c, d: c.model.update(hf_split="1,1,2"),
      "model.hf_split: prelude, core and coda layers must fit in the model's "
      "3 layers .at most 3 in all. with a core of at least 1; got 1,1,2$",
    ),
    (
      lambda c, d: c.data.update(tokenizer=str(d / "tokenizer.json")),
      "data.tokenizer: must be '' or .*llama_gqa/tokenizer.json with",
    ),
    (
      lambda c, d: c.model.update(init_from=f"hf:{larger_tokenizer(d)}"),
      "data.tokenizer: .*tokenizer.json has 65 tokens but .*'s embedding has 64 rows",
    ),
    (
      lambda c, d: c.model.update(init_from=f"hf:{FIXTURES / 'huginn'}"),
      "model.init_from: .* must hold a feedforward llama or olmo2 model; got "
      "model_type 'huginn_raven'$",
    ),
    (
      lambda c, d: c.model.update(hf_dir=str(FIXTURES / "llama_gqa")),
      "model.init_from: trains a language model .*got task 'lm', hf_dir '.*llama_gqa'",
    ),
    (
      lambda c, d: c.model.update(init_from="", hf_split="1,1,1"),
      "model.hf_split: needs model.init_from or model.hf_dir",
    ),
  ],
  ids=[
    "missing_dir",
    "no_prefix",
    "no_split",
    "split_sum",
    "other_tokenizer",
    "tokenizer_size",
    "looped_model",
    "with_hf_dir",
    "split_alone",
  ],
)
def test_bad_input_is_one_line_naming_the_field(tmp_path, setup, message):
  c = config(tmp_path)
  setup(c, tmp_path)
  with pytest.raises(ConfigError, match=message) as e:
    config_lib.validate(c)
    init_from.resolve(c)
  assert "\n" not in str(e.value)


def test_the_command_line_refuses_a_bad_split_before_the_workdir_exists(tmp_path):
  c = config(tmp_path)
  cmd = cli(
    tmp_path / "run",
    c.data.data_dir,
    f"--config.model.init_from={c.model.init_from}",
    "--config.model.hf_split=2,0,1",
    f"--config.data.source={c.data.source}",
  )
  cmd[3] = "--config=experiments/lm.py:retrofit_tiny"
  r = in_process(cmd)
  assert r.returncode == 2 and r.stderr.strip().splitlines() == [
    "error: model.hf_split: prelude, core and coda layers must fit in the "
    "model's 3 layers (at most 3 in all) with a core of at least 1; got 2,0,1"
  ], r.stderr
  assert not (tmp_path / "run").exists()
