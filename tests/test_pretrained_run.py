"""A pretrained model from the command line (loopjax.lm.pretrained): the MECH
analyses on prompts and sampling, on the tiny checkpoints of tests/fixtures/hf,
and bad input refused in one line before anything compiles."""

import json
import shutil
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import pretrained as experiment
from loopjax import config as config_lib
from loopjax import restore
from loopjax.errors import ConfigError
from loopjax.lm import pretrained, sample
from loopjax.pretrained import load
from tests.conftest import in_process

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def config(variant, fixture, **model):
  c = experiment.get_config(variant)
  c.model.update(hf_dir=str(FIXTURES / fixture), dtype="float32")
  c.model.update(model)
  c.analyze.max_depth = 6
  config_lib.validate(c)
  return c


@pytest.mark.slow
def test_analyze_runs_mechs_analyses_on_the_prompts(tmp_path):
  """Huginn on the 8 shipped questions, to 6 recurrences: per-layer fixed
  points of the 2-layer core, stage statistics and attention per iteration,
  each prompt a row whose padding no statistic counts, and each token's exit
  under Huginn's criteria; the config recorded."""
  c = config("huginn", "huginn")
  c.analyze.halting.update(r_max=6, eps=(1e-2,))
  written = pretrained.analyze(c, tmp_path)
  assert {p.name for p in written} >= {"fixed_points.json", "stages.png", "halting.md"}
  exits = json.loads((tmp_path / "analysis" / "halting.json").read_text())
  rows = exits["halting"]["prompts"]["rows"]  # Huginn's 4 criteria, argmax twice
  assert [r["criterion"] for r in rows][-2:] == ["argmax", "argmax"] and len(rows) == 6
  assert all(1 <= r["iterations"] <= 6 and 0 <= r["agree"] <= 1 for r in rows)
  assert rows[-2]["iterations"] < rows[-1]["iterations"]  # patience 2 < 5
  fp = json.loads((tmp_path / "analysis" / "fixed_points.json").read_text())
  assert fp["windows"] == 8 and fp["main_split"] == "prompts"
  assert len(fp["fixed_points"]["prompts"]["layers"]) == 2  # per core layer
  st = json.loads((tmp_path / "analysis" / "stages.json").read_text())["stages"]
  assert st["prompts"]["num_loops"] == 6 and st["prompts"]["num_layers"] == 2
  assert st["prompts"]["memory"]["batch"][0] == 4  # analyze.batch_size prompts
  assert json.loads((tmp_path / "config.json").read_text())["model"]["hf_dir"]
  c2 = config("huginn", "huginn", num_loops=8)  # the workdir holds another run
  with pytest.raises(ConfigError, match="holds a run with another config"):
    pretrained.analyze(c2, tmp_path)


def test_a_sample_past_the_models_reach_is_refused_before_a_weight_is_read(
  monkeypatch,
):
  """100,000 new tokens from a RoPE model (the fixture: a 64-token context; it
  generated until killed): one line at once, no weight read."""
  c = config("ouro", "ouro")
  monkeypatch.setattr(load, "load", lambda *a, **k: pytest.fail("weights read"))
  opened = restore.language_model(c)
  reach = sample.RELATIVE_REACH * opened.text.max_length
  with pytest.raises(ConfigError, match=rf"exceed {reach} positions \(4 x the"):
    sample.sample(c, None, "how many apples", max_new_tokens=100_000)


def test_greedy_sampling_continues_as_the_full_forward_would():
  """Ouro (its state-normed readout through the key/value cache): each greedy
  token is the argmax of the full forward over the text before it (one
  forward over the whole text: teacher forcing)."""
  from loopjax.data import lm
  from loopjax.lm.generate import generate

  c = config("ouro", "ouro")
  text = sample.sample(c, None, "how many apples", max_new_tokens=5, temperature=0.0)
  tok = (FIXTURES / "ouro" / "tokenizer.json").read_text()
  prompt = lm.encode(tok, "how many apples")  # <s> and 3 words
  model = restore.language_model(c).model()
  tokens = np.asarray([prompt + generate(model, [prompt], 5, num_loops=4).tokens[0]])
  decoded = lm.tokenizer_from_json(tok).decode(list(map(int, tokens[0])), True)
  assert text == decoded and tokens.shape == (1, 9)
  logits_TV = model.module()(jnp.asarray(tokens), None)[0]
  np.testing.assert_array_equal(np.argmax(logits_TV[3:-1], -1), tokens[0, 4:])


def test_prompts_rows_pad_on_the_right_and_mask_the_padding():
  from loopjax.lm import prompts

  c = config("llama", "llama_gqa")
  tok = (FIXTURES / "llama_gqa" / "tokenizer.json").read_text()
  task = prompts.lm_data(
    c, tok, ["how many apples", "she has ten apples and two boxes"]
  )
  (batch,), n = prompts.batches(task, ["apples", "she has ten apples"], 4)
  assert n == 2 and batch["inputs"].shape == (2, 4)  # <s> + 4 words, less one
  np.testing.assert_array_equal(batch["real"][0], [True, True, False, False])
  np.testing.assert_array_equal(batch["mask"][0], [1, 0, 0, 0])  # no next token
  np.testing.assert_array_equal(batch["mask"][1], [1, 1, 1, 1])
  assert batch["segments"][0, -1] != batch["segments"][0, 0]  # padding apart


def _dir_with(tmp_path, fixture, edit=None, drop=()):
  out = tmp_path / fixture
  shutil.copytree(FIXTURES / fixture, out)
  for name in drop:
    (out / name).unlink()
  if edit:
    hf = json.loads((out / "config.json").read_text())
    edit(hf)
    (out / "config.json").write_text(json.dumps(hf))
  return out


def test_bad_prompts_tokenizers_and_splits_name_the_field(tmp_path):
  c = config("llama", "llama_gqa")
  bad = tmp_path / "p.jsonl"
  bad.write_text('{"text": "no question field"}\n')
  c.data.source = f"prompts:{bad}"
  with pytest.raises(ConfigError, match=r"p.jsonl:1: not a JSON object with a field"):
    pretrained.analyze(c, tmp_path / "wd")
  c.data.source = f"prompts:{tmp_path / 'none.txt'}"
  with pytest.raises(ConfigError, match="no prompts file"):
    pretrained.analyze(c, tmp_path / "wd")
  c.data.source = experiment.get_config("llama").data.source
  c.model.hf_dir = str(_dir_with(tmp_path, "llama_gqa", drop=["tokenizer.json"]))
  with pytest.raises(ConfigError, match="has no tokenizer.json"):
    pretrained.analyze(c, tmp_path / "wd")
  small = _dir_with(tmp_path / "small", "llama_gqa")  # a 70-token tokenizer
  tok = json.loads((small / "tokenizer.json").read_text())
  tok["model"]["vocab"] |= {f"w{i}": 64 + i for i in range(6)}
  (small / "tokenizer.json").write_text(json.dumps(tok))
  c.model.hf_dir = str(small)
  with pytest.raises(ConfigError, match="70 tokens do not fit the model's 64-row"):
    pretrained.analyze(c, tmp_path / "wd")
  c.model.update(hf_dir=str(FIXTURES / "llama_gqa"), hf_split="2,x")
  with pytest.raises(ConfigError, match="model.hf_split: must be 'prelude,core,coda'"):
    pretrained.analyze(c, tmp_path / "wd")
  assert not (tmp_path / "wd").exists()  # nothing written


def test_the_command_line_refuses_bad_input_with_one_line(tmp_path):
  base = [sys.executable, "-m", "loopjax.main",
          "--config=experiments/pretrained.py:ouro",
          f"--workdir={tmp_path / 'wd'}", "--mode=analyze"]  # fmt: skip
  unknown = _dir_with(tmp_path, "ouro", lambda hf: hf.update(model_type="gpt9"))
  c = experiment.get_config("ouro")  # in process: a validation error
  with pytest.raises(ConfigError, match="model.hf_dir: a local Hugging Face model"):
    config_lib.validate(c)
  for extra, message in [
    ([f"--config.model.hf_dir={unknown}"], "model_type must be one of"),
    ([f"--config.model.hf_dir={FIXTURES / 'ouro'}", "--mode=train"], "--mode=train"),
  ]:
    res = in_process(base + extra)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], res.stderr
  assert not (tmp_path / "wd").exists()


def test_a_model_loads_into_its_shards_and_computes_the_same():
  """On a 2 x 2 x 2 mesh each tensor goes straight to its shards (the
  embedding split over tensor and fsdp) and the logits are unchanged."""
  import jax

  from loopjax import sharding
  from loopjax.pretrained.load import load

  c = config("huginn", "huginn")
  c.mesh.update(data=2, fsdp=2, tensor=2, devices=8)
  mesh, rules = sharding.make_mesh(c.mesh), tuple(c.sharding.rules)
  _, model = load(
    c.model.hf_dir, c.model, None, 3, overrides={"init_state": "zeros"},
    mesh=mesh, rules=rules,
  )  # fmt: skip
  embed = model.params["embed"][...]
  assert tuple(embed.sharding.spec) == ("tensor", "fsdp")
  assert embed.addressable_shards[0].data.shape == (32, 16)
  ref = np.load(FIXTURES / "huginn" / "reference.npz")
  out = jax.jit(lambda m, t: m.module()(t, None, num_loops=3))(model, ref["ids"])
  np.testing.assert_allclose(out, ref["logits_3"], atol=1e-4)


@pytest.mark.slow
def test_aot_reports_a_pretrained_models_memory_from_its_config_alone(tmp_path):
  """config.json without weights: the analysis pass and the forward compile
  on the target mesh; sharding the params 4 ways divides their bytes nearly
  by 4 (norm scales and biases stay whole: a third of this tiny model's)."""
  import jax

  from loopjax import passes

  shape_only = tmp_path / "huginn"
  shape_only.mkdir()
  shutil.copy(FIXTURES / "huginn" / "config.json", shape_only)
  reports = []
  for fsdp in (1, 4):
    c = config("huginn", "huginn", hf_dir=str(shape_only))
    c.mesh.update(data=1, fsdp=fsdp, tensor=1)
    reports.append(passes.check_pretrained(c, jax.devices()[:fsdp]))
  one, four = (
    next(v for k, v in r["passes"].items() if k.startswith("analysis, 6 iterations"))
    for r in reports
  )
  model = restore.language_model(config("huginn", "huginn")).model()
  sizes = [x.size for x in jax.tree.leaves(model.params)]
  assert reports[0]["params"] == sum(sizes)  # every param, none twice
  assert 2.5 < one["arguments"] / four["arguments"] <= 4.0
  assert one["temporaries"] > 0


@pytest.mark.slow  # ~22 s: three analyses of pretrained fixtures
def test_a_feedforward_baselines_stages_beside_the_looped_models(tmp_path):
  """analyze.baseline_dir: the retrofitted model's stages and its source's
  (here a 3-layer Llama) on the same prompts, and one figure of both, with
  each token's exits; a looped directory as the baseline is refused before
  anything loads."""
  c = config("retrofit", "retrofit_llama")
  c.analyze.update(names=("stages", "halting"), max_depth=3)
  c.analyze.halting.update(criteria=("argmax", "fixed"), patience=(1,), r_max=3)
  c.analyze.baseline_dir = str(FIXTURES / "huginn")
  with pytest.raises(ConfigError, match="must be a feedforward Llama or OLMo 2"):
    pretrained.analyze(c, tmp_path)
  assert not tmp_path.joinpath("config.json").exists()
  c.analyze.baseline_dir = str(FIXTURES / "llama_gqa")
  written = {p.name for p in pretrained.analyze(c, tmp_path)}
  assert "stages_vs_baseline.png" in written
  fed = json.loads((tmp_path / "analysis" / "baseline" / "stages.json").read_text())
  rows = fed["stages"]["prompts"]["positions"]
  assert [r["label"] for r in rows] == ["embed", "r1 l1", "r1 l2", "r1 l3"]
  exits = json.loads((tmp_path / "analysis" / "halting.json").read_text())
  argmax, fixed = exits["halting"]["prompts"]["rows"]  # per token
  assert argmax["criterion"] == "argmax" and 1 < argmax["iterations"] < 3
  assert argmax["agree"] < 1  # patience 1 exits some tokens on another answer
  # never exiting is the r_max forward: every token, every answer, the loss
  assert (fixed["iterations"], fixed["early"], fixed["agree"]) == (3, 0, 1)
  assert fixed["loss"] == pytest.approx(fixed["loss_full"], abs=1e-5)


@pytest.mark.slow  # ~13 s: a pretrained analysis end to end with answers
def test_answers_are_scored_beside_each_questions_statistics(tmp_path):
  """data.answer_field: each question answered greedily at R and scored by
  its last number against the gold's; answers.jsonl holds each question's
  correctness with its read change, settled share and sink at R and at the
  deepest iteration, answers.md the means over right and wrong."""
  c = config("ouro", "ouro")
  c.analyze.update(names=("fixed_points", "stages"), answer_tokens=4)
  questions = ["2 apples and 3 apples", "one two three", "how many apples"]
  path = tmp_path / "q.jsonl"
  path.write_text(
    "".join(
      json.dumps({"q": q, "a": f"so\n#### {i}"}) + "\n" for i, q in enumerate(questions)
    )
  )
  c.data.update(source=f"prompts:{path}", text_field="q", answer_field="a")
  written = pretrained.analyze(c, tmp_path / "w")
  assert tmp_path / "w" / "analysis" / "answers.jsonl" in written
  rows = [json.loads(x) for x in (tmp_path / "w/analysis/answers.jsonl").open()]
  assert [r["gold"] for r in rows] == ["0", "1", "2"]
  assert all(r["correct"] == (r["predicted"] == r["gold"]) for r in rows)
  assert all(0 <= r["settled_at_R"] <= 1 and r["read_change_last"] >= 0 for r in rows)
  assert all(0 <= r["sink_at_R"] <= 1 and 0 <= r["sink_last"] <= 1 for r in rows)
  assert "| sink_at_R |" in (tmp_path / "w/analysis/answers.md").read_text()
  c.data.answer_field = "missing"
  with pytest.raises(ConfigError, match="q.jsonl:1: .*answer_field='missing'"):
    pretrained.analyze(c, tmp_path / "w2")


def test_an_answer_is_right_when_its_last_number_is_the_golds(tmp_path):
  """A model whose every token is a digit (a word-level tokenizer of the ten):
  the gold set to its own greedy answer's last number is right, another
  wrong; GSM8K's "####" and commas read as lm-evaluation-harness reads them."""
  from types import SimpleNamespace

  from flax import nnx
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  from experiments import lm as lm_experiment
  from loopjax.data import lm
  from loopjax.lm import answers
  from loopjax.lm.generate import generate
  from loopjax.state import Model, build_model

  assert answers.final_number("so 1,234.0 apples, then 7.5") == "7.5"
  assert answers.gold("48 + 24 = 72\n#### 72") == "72" and answers.gold("no") is None
  tok = Tokenizer(models.WordLevel({str(i): i for i in range(10)}, unk_token="0"))
  tok.pre_tokenizer, tok.decoder = (
    pre_tokenizers.WhitespaceSplit(),
    decoders.WordPiece(),
  )
  task = SimpleNamespace(tokenizer_json=tok.to_str(), eos_id=None, seq_len=16)
  m = lm_experiment.get_config("tiny").model
  m.update(d_model=32, num_heads=4, num_loops=2)
  net = build_model(m, 10, 32, seed=0)
  model = Model(nnx.graphdef(net), nnx.to_pure_dict(nnx.state(net, nnx.Param)))
  prompts = ["1 2 3", "4 5"]
  said = generate(model, [lm.encode(task.tokenizer_json, prompts[0])], 3, num_loops=2)
  last = answers.final_number(lm.decode(task.tokenizer_json, said.tokens[0]))
  assert last is not None
  golds = [f"#### {last}", f"#### {int(last) + 1},000"]
  stats = [{"sink_at_R": 0.5}, {"sink_at_R": 0.1}]
  answers.score(
    model, task, prompts, golds, num_loops=2, tokens=3, stats=stats, out_dir=tmp_path
  )
  rows = [json.loads(x) for x in (tmp_path / "answers.jsonl").open()]
  assert [r["correct"] for r in rows] == [True, False]
  assert rows[1]["gold"] == f"{int(last) + 1}000"
  assert "| sink_at_R | 0.5 | 0.1 |" in (tmp_path / "answers.md").read_text()


def test_one_prefix_rule_for_runs_and_pretrained_directories(tmp_path):
  """`restore.Text`: a data.bos run's texts start with <bos>, one without
  with nothing (an empty text with <eos>); a pretrained tokenizer writes its
  own <bos> (an empty text starts with it)."""
  from experiments import lm as lm_experiment
  from loopjax.data import lm

  tok = (FIXTURES / "huginn" / "tokenizer.json").read_text()
  (tmp_path / "tokenizer.json").write_text(tok)
  _, bos, eos = lm.special_ids(tok, "tokenizer.json")
  c = lm_experiment.get_config("tiny")
  for on, prefix, start in ((True, [bos], bos), (False, [], eos)):
    c.data.bos = on
    text = restore.language_model(c, tmp_path).text
    assert (text.prefix_ids, text.start_id, text.eos_id) == (prefix, start, eos)
  opened = restore.language_model(restore.pretrained_config(FIXTURES / "huginn"))
  assert (opened.text.prefix_ids, opened.text.start_id) == ([], bos)
  assert opened.num_loops == 4  # 0: the directory's own (mean_recurrence)
