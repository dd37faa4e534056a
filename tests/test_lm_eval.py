"""lm-evaluation-harness's model `loopjax`, offline: the harness's local task
format (YAML over a JSONL file written here), one multiple-choice and one
generation task, on the tiny Ouro checkpoint of tests/fixtures/hf."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import QUESTIONS, offline_env, write_tasks

lm_eval = pytest.importorskip("lm_eval")

from loopjax import config as config_lib  # noqa: E402
from loopjax.errors import ConfigError  # noqa: E402
from loopjax.lm import harness, harness_args, harness_hub, sample  # noqa: E402
from loopjax.pretrained.load import load  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "ouro"
TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
  "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
  """The task directory (`write_tasks`)."""
  return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
  for name, value in offline_env(tmp_path).items():
    monkeypatch.setenv(name, value)


def evaluate(tasks, names, model_dir=FIXTURE, **model_args):
  from lm_eval import simple_evaluate
  from lm_eval.tasks import TaskManager

  model = harness.LoopjaxLM(hf_dir=str(model_dir), batch_size=2, **model_args)
  out = simple_evaluate(
    model=model,
    tasks=names,
    task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
    log_samples=True,
  )
  return model, out


def greedy(model_dir, question: str) -> str:
  """loopjax.sample's greedy text at R 4: the prompt, then 6 new tokens."""
  c = config_lib.base()
  c.model.update(hf_dir=str(model_dir), num_loops=4)
  return sample.sample(c, None, question, max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def newline_model(tmp_path_factory):
  """The tiny Ouro checkpoint with a tokenizer that decodes a word its greedy
  continuation of the first question makes as a newline, so that the stop
  string "\n" has something to stop at."""
  asked = {w for q in QUESTIONS for w in q["question"].split()}
  made = greedy(FIXTURE, QUESTIONS[0]["question"]).split()[1 + 3 :]  # <s> q
  word = next(w for w in made if w not in asked)
  out = tmp_path_factory.mktemp("nl") / "ouro"
  shutil.copytree(FIXTURE, out)
  tok = json.loads((out / "tokenizer.json").read_text())
  tok["model"]["vocab"]["\n"] = tok["model"]["vocab"].pop(word)
  (out / "tokenizer.json").write_text(json.dumps(tok))
  return out


@pytest.fixture(scope="module")
def at_r4(tasks, newline_model, tmp_path_factory):
  """Both tasks at R 4 with the harness's defaults (add_bos_token unset: the
  tokenizer adds <s>, so the prompt ids are loopjax.sample's), each request's
  recurrences recorded."""
  root = tmp_path_factory.mktemp("r4")
  with pytest.MonkeyPatch.context() as mp:
    for name, value in offline_env(root).items():
      mp.setenv(name, value)
    model, out = evaluate(
      tasks, ["toy_mc", "toy_gen"], newline_model, num_loops=4,
      record=str(root / "record.jsonl"),
    )  # fmt: skip
  lines = [json.loads(x) for x in (root / "record.jsonl").read_text().splitlines()]
  return model, out, lines


def test_multiple_choice_loglikelihoods_are_a_direct_forwards(at_r4):
  """Each choice's score is the sum of log-softmax of one forward at R over
  question + choice (batched, padded, sorted by length in the harness); the
  record has every request at R."""
  model, out, lines = at_r4
  _, direct = load(FIXTURE, config_lib.base().model, None, 4)
  bos = model.scorer.start_id
  assert model.tok_encode("how many")[0] == bos  # <s>, as the tokenizer adds it
  assert model.tok_encode("<s> how many")[:2] == [bos, model.tok_encode("how")[1]]
  for s in out["samples"]["toy_mc"]:
    doc = s["doc"]
    for choice, resp in zip(doc["choices"], s["resps"], strict=True):
      got = resp[0][0]  # (log-likelihood, greedy) of the one request
      ctx = model.tok_encode(doc["question"])
      whole = model.tok_encode(doc["question"] + choice)
      logits = direct.module()(np.asarray([whole[:-1]]), None, num_loops=4)[0]
      logp = np.asarray(jax.nn.log_softmax(logits))
      cont = range(len(ctx), len(whole))
      want = sum(logp[t - 1, whole[t]] for t in cont)
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  scored = [x for x in lines if x["request"] == "loglikelihood"]
  assert len(scored) == sum(len(q["choices"]) for q in QUESTIONS)
  assert {x["iterations"] for x in scored} == {4.0}
  assert 0.0 <= out["results"]["toy_mc"]["acc,none"] <= 1.0


def test_greedy_generation_is_mode_samples_text_cut_at_the_stop_string(
  at_r4, newline_model
):
  """Each text is loopjax.sample's continuation cut before the first stop
  string; the first question's runs into a real newline (YAML's "\\n")."""
  model, out, lines = at_r4
  cut = []
  for s in out["samples"]["toy_gen"]:
    q = s["doc"]["question"]
    whole = greedy(newline_model, q)
    # loopjax.sample's text starts with the prompt's and runs on to 6 tokens
    prompt = model.scorer.decode(model.tok_encode(q))
    continued = whole[len(prompt) :]
    want = continued.split("\n")[0].split("apples")[0]
    assert s["resps"][0][0] == want
    cut.append(want != continued.split("apples")[0])
  assert cut[0], "the newline stop was never reached"
  gen = [x for x in lines if x["request"] == "generate_until"]
  assert len(gen) == len(QUESTIONS) and all(set(x["iterations"]) == {4} for x in gen)


def test_an_exit_rule_records_each_new_tokens_recurrences(tasks, tmp_path):
  """Ouro's gate at 0.5: the recurrences of every generated token are
  recorded, each between 1 and R, and the scores' means likewise."""
  record = tmp_path / "record.jsonl"
  evaluate(
    tasks, ["toy_gen", "toy_mc"], num_loops=4, exit="gate", threshold=0.5,
    record=str(record),
  )  # fmt: skip
  lines = [json.loads(x) for x in record.read_text().splitlines()]
  gen = [x for x in lines if x["request"] == "generate_until"]
  assert len(gen) == len(QUESTIONS)
  assert all(1 <= i <= 4 for x in gen for i in x["iterations"])
  scored = [x["iterations"] for x in lines if x["request"] == "loglikelihood"]
  assert scored and all(1.0 <= i <= 4.0 for i in scored)


def test_log_likelihoods_at_several_depths_come_from_one_pass():
  """With depths, each request is scored at every depth in one pass and kept;
  each depth's score equals a scorer's at that R alone."""
  from loopjax.lm import scoring

  requests = [([1, 5, 9], [7, 3]), ([2], [4, 4, 8]), ([6, 1, 2, 3, 9], [5])]
  shared = scoring.load(hf_dir=str(FIXTURE), batch_size=2).scorer
  shared.depths = (1, 3)
  for R in (3, 1):
    shared.num_loops = R
    alone = scoring.load(hf_dir=str(FIXTURE), num_loops=R, batch_size=2).scorer
    got, want = shared.loglikelihood(requests), alone.loglikelihood(requests)
    np.testing.assert_allclose(
      [s.logprob for s in got], [s.logprob for s in want], rtol=1e-5
    )
    assert [s.greedy for s in got] == [s.greedy for s in want]
    assert {s.iterations for s in got} == {float(R)}
  assert len(shared._kept) == len(requests)  # the second depth read them


def test_the_chat_template_renders_from_tokenizer_config(tmp_path):
  d = tmp_path / "ouro"
  shutil.copytree(FIXTURE, d)
  (d / "tokenizer_config.json").write_text(
    json.dumps({"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}})
  )
  model = harness.LoopjaxLM(hf_dir=str(d))
  text = model.apply_chat_template([{"role": "user", "content": "hi"}])
  assert text == "<s><|user|>hi\n<|assistant|>"
  (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
  with pytest.raises(ConfigError, match="chat_template does not render"):
    harness.LoopjaxLM(hf_dir=str(d))


def run(*args):
  return subprocess.run(
    [sys.executable, "-m", *args], capture_output=True, text=True, timeout=300
  )


def test_bad_model_arguments_name_the_argument(tmp_path):
  """A directory with no tokenizer, an unknown exit rule, a gate the model
  lacks, a bad start: one ConfigError line each, before any weight is read
  (the command lines' exit 2 on them: the slow test below)."""
  no_tok = tmp_path / "no_tok"
  shutil.copytree(FIXTURE, no_tok)
  (no_tok / "tokenizer.json").unlink()
  for args, says in [
    (dict(hf_dir=str(no_tok)), "no tokenizer.json"),
    (dict(hf_dir=str(FIXTURE), exit="nope"), "not a per-token halting criterion"),
    (dict(hf_dir=str(FIXTURE.parent / "huginn"), exit="gate"), "has none"),
    (dict(hf_dir=str(FIXTURE), exit="kl", start="first"), "start: must be one of"),
  ]:
    with pytest.raises(ConfigError, match=says):
      harness.LoopjaxLM(**args)
  with pytest.raises(TypeError, match="unexpected keyword argument 'num_loop'"):
    harness.LoopjaxLM(hf_dir=str(FIXTURE), num_loop=8)  # main() exits 2 on it


@pytest.mark.parametrize(
  "args, says",
  [
    (dict(num_loops=0), "num_loops must be an integer >= 1; got 0"),
    (dict(num_loops=-1), "num_loops must be an integer >= 1; got -1"),
    (dict(num_loops="abc"), "num_loops must be an integer >= 1; got 'abc'"),
    (dict(num_loops=2.5), "num_loops must be an integer >= 1; got 2.5"),
    (dict(dtype="float16x"), "dtype must be one of float32, bfloat16; got 'float16x'"),
    (dict(batch_size=0), "batch_size must be an integer >= 1"),
    (dict(max_gen_toks=-3), "max_gen_toks must be an integer >= 1"),
    (dict(add_bos_token="yes"), "add_bos_token must be True or False"),
    (dict(threshold="high", exit="kl"), "threshold must be a number"),
    (dict(hf_dir=str(FIXTURE)), "give pretrained= or hf_dir= (the same), not both"),
  ],
)
def test_numbers_dtypes_and_flags_are_checked_before_a_weight_is_read(
  args, says, monkeypatch
):
  """Each bad model argument is one ConfigError line; the checkpoint is never
  opened (loading raises if reached)."""
  from loopjax.lm import scoring

  monkeypatch.setattr(scoring, "load", lambda **kw: pytest.fail("loaded"))
  with pytest.raises(ConfigError, match=re.escape(says)):
    harness.LoopjaxLM(**{"pretrained": str(FIXTURE)} | args)


def test_model_args_batch_size_wins_over_the_harness_flag():
  """docs/pretrained.md's `batch_size` in --model_args: the harness passes
  its own --batch_size too; the model argument is used, not a TypeError."""
  model = harness.LoopjaxLM.create_from_arg_string(
    f"pretrained={FIXTURE},batch_size=3", {"batch_size": 1, "device": None}
  )
  assert model.scorer.batch_size == 3
  model = harness.LoopjaxLM.create_from_arg_obj(  # the command line's way
    {"pretrained": str(FIXTURE), "batch_size": 3}, {"batch_size": "1", "device": None}
  )
  assert model.scorer.batch_size == 3


@pytest.mark.parametrize("flag, used", [("2", 2), ("auto", 8), ("auto:4", 8)])
def test_the_harness_batch_size_flag_is_read_as_it_writes_it(flag, used):
  """The harness's own `--batch_size` reaches the model as a string."""
  harness_args.precheck(["--model", "loopjax", "--batch_size", flag])
  model = harness.LoopjaxLM.create_from_arg_string(
    f"pretrained={FIXTURE}", {"batch_size": flag, "device": None}
  )
  assert model.scorer.batch_size == used


def test_an_unknown_task_says_where_to_look(tasks, tmp_path):
  """A missing --include_path (before the harness indexes its tasks or a
  model is opened: config None would fail), a YAML file that does not load
  (the harness skips it without a word) and a name no file has: three lines."""
  nowhere = tmp_path / "nowhere"
  with pytest.raises(ConfigError, match=f"--include_path={nowhere}: no such directory"):
    harness.run(None, tmp_path, tasks=["toy_mc"], include_path=str(nowhere))
  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / "toy_broken.yaml").write_text("task: toy_broken\ndataset_path: [json\n")
  assert harness_hub.why_unknown("toy_broken", str(broken)).startswith(
    f"{broken / 'toy_broken.yaml'} names it but does not load: "
  )
  assert harness_hub.why_unknown("toy_broken", str(tasks)) == (
    f"no YAML file under --include_path={tasks} names it"
  )


@pytest.mark.slow  # ~20 s: the harness indexes its own tasks
def test_a_data_set_the_hub_cannot_send_is_one_line(tmp_path):
  """A task on a hub data set that is not on disk, offline (as on a cluster
  with no route to the hub): the datasets library's ConnectionError becomes
  one line saying what to do."""
  (tmp_path / "hub_t.yaml").write_text(
    "task: hub_t\ndataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy\n"
    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
    "doc_to_choice: '{{choices.text}}'\ndoc_to_target: 0\n"
  )
  c = config_lib.base()
  c.model.update(hf_dir=str(FIXTURE), num_loops=2)
  c.data.task = "lm"
  with pytest.raises(ConfigError, match=r"data set is not on disk and cannot be "):
    harness.run(c, tmp_path / "w", tasks=["hub_t"], include_path=str(tmp_path))


def test_a_bad_harness_batch_size_flag_is_one_line():
  with pytest.raises(ConfigError, match="batch_size must be an integer >= 1; got '0x'"):
    harness_args.precheck(["--model", "loopjax", "--batch_size=0x"])


def test_the_requests_record_on_a_bucket_keeps_every_call(bucket):
  """Each call's requests follow the earlier calls' in the record: on a
  bucket, where an append would replace the object, it is rewritten whole."""
  from types import SimpleNamespace

  from loopjax import storage

  model = harness.LoopjaxLM.__new__(harness.LoopjaxLM)
  model.record = storage.path(f"{bucket}/lm_eval/requests_r2.jsonl")
  request = lambda i: SimpleNamespace(task_name="t", doc_id=i, idx=0)  # noqa: E731
  model._write([request(0)], "loglikelihood", [2.0])
  model._write([request(1), request(2)], "generate_until", [[2, 1], [2]])
  lines = [json.loads(x) for x in model.record.read_text().splitlines()]
  assert [(x["doc_id"], x["request"], x["iterations"]) for x in lines] == [
    (0, "loglikelihood", 2.0),
    (1, "generate_until", [2, 1]),
    (2, "generate_until", [2]),
  ]


@pytest.mark.slow
def test_the_harness_command_line_and_mode_lm_eval_score_the_model(tasks, tmp_path):
  """`--model loopjax` through the harness's own command line, and
  `python -m loopjax.lm_eval` at two recurrences: results, per-R files and the table;
  bad input through both exits 2 in one line."""
  r = run(
    "loopjax.lm.harness", "--model", "loopjax", "--include_path", str(tasks),
    "--model_args", f"hf_dir={FIXTURE},num_loops=2", "--tasks", "toy_mc",
    "--output_path", str(tmp_path / "cli"),
  )  # fmt: skip
  assert r.returncode == 0, r.stderr[-3000:]
  bad = run(
    "loopjax.lm.harness", "--model", "loopjax", "--include_path", str(tasks),
    "--model_args", f"hf_dir={FIXTURE},num_loop=2", "--tasks", "toy_mc",
  )  # fmt: skip
  assert bad.returncode == 2 and "num_loop" in bad.stderr.strip().splitlines()[-1]
  no_tok = tmp_path / "no_tok"
  shutil.copytree(FIXTURE, no_tok)
  (no_tok / "tokenizer.json").unlink()
  bad = run(
    "loopjax.lm.harness", "--model", "loopjax", "--include_path", str(tasks),
    "--model_args", f"hf_dir={no_tok}", "--tasks", "toy_mc",
  )  # fmt: skip
  assert bad.returncode == 2 and "no tokenizer.json" in bad.stderr.splitlines()[-1]
  bad = run(
    "loopjax.lm_eval", f"--workdir={tmp_path / 'w0'}",
    "--config=experiments/pretrained.py:ouro", f"--config.model.hf_dir={FIXTURE}",
    "--tasks=no_such_task", f"--include_path={tasks}",
  )  # fmt: skip
  assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
  assert "unknown task 'no_such_task'" in bad.stderr
  (results,) = (tmp_path / "cli").rglob("results_*.json")
  assert "acc,none" in json.loads(results.read_text())["results"]["toy_mc"]
  w = tmp_path / "w"
  r = run(
    "loopjax.lm_eval", f"--workdir={w}", "--num_loops=1,4",
    "--config=experiments/pretrained.py:ouro", f"--config.model.hf_dir={FIXTURE}",
    "--tasks=toy_mc", f"--include_path={tasks}",
  )  # fmt: skip
  assert r.returncode == 0, r.stderr[-3000:]
  assert "| toy_mc | acc,none |" in (w / "lm_eval" / "table.md").read_text()
  for R in (1, 4):
    assert "toy_mc" in json.loads((w / "lm_eval" / f"r{R}.json").read_text())
    used = [json.loads(x) for x in (w / "lm_eval" / f"requests_r{R}.jsonl").open()]
    assert {x["iterations"] for x in used} == {float(R)}


@pytest.mark.slow
def test_a_loopjax_runs_checkpoint_is_scored_as_its_forward(lm_config, tasks, tmp_path):
  """model_args workdir=RUN: the run's tokenizer and checkpoint; a
  multiple-choice score is the run's own forward's at the R asked for."""
  from loopjax import restore, train
  from loopjax.data import lm

  lm_config.train.num_steps = 10
  train.train_and_evaluate(lm_config, tmp_path / "run")
  model = harness.LoopjaxLM(workdir=str(tmp_path / "run"), num_loops=3)
  tok = (tmp_path / "run" / "tokenizer.json").read_text()
  task = lm.without_streams(lm_config.data, tok)
  _, direct, _ = restore.from_checkpoint(lm_config, tmp_path / "run", task=task)
  (score,) = model.scorer.loglikelihood([([task.bos_id], [5, 6, 7])])
  logits = direct.module()(np.asarray([[task.bos_id, 5, 6]]), None, num_loops=3)[0]
  logp = np.asarray(jax.nn.log_softmax(logits))
  want = logp[0, 5] + logp[1, 6] + logp[2, 7]
  np.testing.assert_allclose(score.logprob, want, rtol=1e-5)
  assert score.iterations == 3.0
