"""An external oracle for the harness model `loopjax`: lm-evaluation-harness's
own `hf` model (transformers' LlamaForCausalLM on CPU torch) scores the same
local tasks on a Llama checkpoint that transformers 5 writes at test time
(RoPE's base in `rope_parameters`, none at the top level), each at its
defaults; every request must agree. Needs the `oracle` extra (torch,
transformers >= 5, accelerate) beside `test`; skipped without it."""

import json
import random
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", minversion="2.4")
transformers = pytest.importorskip("transformers", minversion="5")
pytest.importorskip("accelerate")  # the harness's `hf` model imports it
pytest.importorskip("lm_eval", minversion="0.4.13")

# Registers `loopjax` after the harness's own models (its registry adds them
# only while it is empty): `--model hf` still resolves.
import loopjax.lm.harness  # noqa: E402, F401

TOKENIZER = Path(__file__).parent / "fixtures" / "hf" / "llama_gqa" / "tokenizer.json"
SPECIALS = ["<s>", "</s>", "<pad>", "<unk>"]
WINDOW = 64  # max_position_embeddings: both models' max_length
BATCH = 4  # both models'; the generation task also runs loopjax at 1 and 5
STOP = "six"  # the generation task's stop string, a word of the vocabulary
TOL = 1e-4  # |log-likelihood difference| per request (float32 both sides)
TASKS = ("oracle_mc", "oracle_ll", "oracle_rolling", "oracle_gen")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
  """A tiny model's forwards are faster on one thread (several times so on a
  busy machine); set back afterwards."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A tiny Llama (grouped-query attention, untied head, norm scales off 1 so
  that they matter) saved by transformers 5, with the fixtures' word-level
  tokenizer as transformers loads it."""
  cfg = transformers.LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=WINDOW,
    rope_theta=5e5, rms_norm_eps=1e-5, initializer_range=0.2,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2,
  )  # fmt: skip
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.mul_(1 + 0.3 * torch.randn_like(p))
  out = tmp_path_factory.mktemp("oracle") / "llama"
  model.save_pretrained(out, safe_serialization=True)
  saved = json.loads((out / "config.json").read_text())
  assert saved["rope_parameters"]["rope_theta"] == 5e5, saved  # the v5 format
  assert "rope_theta" not in saved and "rope_scaling" not in saved, saved
  shutil.copy(TOKENIZER, out / "tokenizer.json")
  # PreTrainedTokenizerFast: tokenizer.json as it is (its post-processor adds
  # <s>); a model-specific class could rebuild it
  specials = dict(zip(("bos", "eos", "pad", "unk"), SPECIALS, strict=True))
  (out / "tokenizer_config.json").write_text(
    json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast"}
      | {f"{k}_token": v for k, v in specials.items()}
    )
  )
  tok = transformers.AutoTokenizer.from_pretrained(out)
  assert isinstance(tok, transformers.PreTrainedTokenizerFast), type(tok)
  assert [tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token] == SPECIALS
  ids = tok.encode("how many apples")
  assert ids[0] == 0 and len(ids) == 4 and 3 not in ids, ids
  return out


def words() -> list[str]:
  """The tokenizer's 60 words (no specials): every text here is made of them."""
  vocab = json.loads(TOKENIZER.read_text())["model"]["vocab"]
  return [w for w, _ in sorted(vocab.items(), key=lambda x: x[1]) if w not in SPECIALS]


def documents(checkpoint) -> dict[str, list[dict]]:
  """Each task's documents, seeded; every other loglikelihood continuation is
  the checkpoint's own greedy one (so that is_greedy is True for some)."""
  rng, vocab = random.Random(0), words()
  text = lambda lo, hi: " ".join(rng.choices(vocab, k=rng.randint(lo, hi)))
  mc = []
  for _ in range(30):
    n = rng.randint(2, 4)
    choices = [text(1, 3) for _ in range(n)]
    mc.append({"question": text(3, 10), "choices": choices, "answer": rng.randrange(n)})
  ll = [{"context": text(1, 12), "continuation": " " + text(1, 5)} for _ in range(20)]
  greedy = greedy_words(checkpoint)
  for doc in ll[::2]:
    doc["continuation"] = " " + greedy(doc["context"], rng.randint(1, 3))
  # <s> and 70-126 words: two windows each. A window's log-likelihood is a
  # float32 sum of about -300 (spacing 3e-5) on either side; more windows
  # would add up their roundings towards TOL.
  rolling = [{"page": text(70, 126)} for _ in range(10)]
  gen = [{"question": text(3, 12)} for _ in range(10)]
  return {"mc": mc, "ll": ll, "rolling": rolling, "gen": gen}


def greedy_words(checkpoint):
  """f(context, n): up to `n` words of transformers' greedy continuation of
  `context` (fewer where it would end the text), spaced as the tasks' texts."""
  tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
  model = transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()

  def f(context: str, n: int) -> str:
    ids, new = tok.encode(context), []
    with torch.no_grad():
      for _ in range(n):
        nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
        if nxt < len(SPECIALS):
          break
        new.append(nxt)
    return " ".join(tok.convert_ids_to_tokens(new or ids[-1:]))

  return f


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, checkpoint):
  """A task directory: oracle_mc (multiple choice), oracle_ll (loglikelihood),
  oracle_rolling (loglikelihood_rolling over texts longer than the window),
  oracle_gen (greedy generate_until the word STOP)."""
  root = tmp_path_factory.mktemp("tasks")
  specs = {
    "mc": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
    "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
    "metric_list:\n  - metric: acc\n",
    "ll": "output_type: loglikelihood\ndoc_to_text: '{{context}}'\n"
    "doc_to_target: '{{continuation}}'\nmetric_list:\n  - metric: perplexity\n"
    "  - metric: acc\n",
    "rolling": "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
    "doc_to_target: '{{page}}'\nmetric_list:\n  - metric: word_perplexity\n",
    "gen": "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
    f"doc_to_target: ' two'\ngeneration_kwargs:\n  until: ['{STOP}']\n"
    "  max_gen_toks: 8\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
  }
  for name, docs in documents(checkpoint).items():
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / f"oracle_{name}.yaml").write_text(
      f"task: oracle_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
      f"    test: {data}\n  cache_dir: {root / 'datasets'}\n"
      f"test_split: test\n{specs[name]}"
    )
  return root


def evaluate(tasks, names, model: str, model_args: str, batch_size: int = BATCH):
  """`simple_evaluate` of `names`, offline, every request's sample logged
  (the tasks name their cache: `datasets` reads HF_DATASETS_CACHE when first
  imported, which may be before this)."""
  from lm_eval import simple_evaluate
  from lm_eval.tasks import TaskManager

  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_DATASETS_CACHE", str(tasks / "datasets"))
    return simple_evaluate(
      model=model,
      model_args=model_args,
      tasks=list(names),
      batch_size=batch_size,
      device="cpu",
      task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
      log_samples=True,
      bootstrap_iters=0,  # stderrs only; no worker pool beside JAX's threads
    )


@pytest.fixture(scope="module")
def runs(checkpoint, tasks):
  """Every task scored by the harness's `hf` model (float32, as the checkpoint
  is stored) and by `loopjax`, each at its defaults otherwise."""
  return {
    "hf": evaluate(tasks, TASKS, "hf", f"pretrained={checkpoint},dtype=float32"),
    "loopjax": evaluate(tasks, TASKS, "loopjax", f"pretrained={checkpoint}"),
  }


def samples(out, task: str) -> dict[int, dict]:
  """{doc_id: the logged sample} of one task."""
  got = {s["doc_id"]: s for s in out["samples"][task]}
  assert len(got) == len(out["samples"][task])
  return got


def paired(runs, task: str):
  """(hf's sample, loopjax's sample) per document, in doc_id order."""
  hf, ours = samples(runs["hf"], task), samples(runs["loopjax"], task)
  assert sorted(hf) == sorted(ours) and hf
  return [(hf[i], ours[i]) for i in sorted(hf)]


@pytest.mark.slow
def test_multiple_choice_log_likelihoods_and_accuracy_agree(runs):
  """Each choice's log-likelihood (context <s> + question, as the tokenizer
  encodes it) within TOL; each document's accuracy, hence the task's, equal."""
  pairs = paired(runs, "oracle_mc")
  assert len(pairs) == 30
  for hf, ours in pairs:
    want = [r[0] for r in hf["filtered_resps"]]
    got = [r[0] for r in ours["filtered_resps"]]
    assert len(got) == len(want) == len(hf["doc"]["choices"])
    assert max(abs(a - b) for a, b in zip(want, got, strict=True)) < TOL, (
      hf["doc_id"], want, got,
    )  # fmt: skip
    assert ours["acc"] == hf["acc"], (hf["doc_id"], want, got)
  r = runs["hf"]["results"]["oracle_mc"], runs["loopjax"]["results"]["oracle_mc"]
  assert r[0]["acc,none"] == r[1]["acc,none"]


@pytest.mark.slow
def test_loglikelihood_requests_agree(runs):
  """Each continuation's log-likelihood within TOL, and whether greedy
  decoding would produce it (the task's acc) the same."""
  pairs = paired(runs, "oracle_ll")
  assert len(pairs) == 20
  for hf, ours in pairs:
    (want, want_greedy), (got, got_greedy) = hf["resps"][0][0], ours["resps"][0][0]
    assert abs(want - got) < TOL, (hf["doc_id"], want, got)
    assert bool(got_greedy) == bool(want_greedy), (hf["doc_id"], want, got)
  r = runs["hf"]["results"]["oracle_ll"], runs["loopjax"]["results"]["oracle_ll"]
  assert r[0]["acc,none"] == r[1]["acc,none"]


@pytest.mark.slow
def test_rolling_log_likelihoods_agree_over_several_windows(runs, checkpoint):
  """Each text's rolling log-likelihood (the harness's windows of WINDOW
  tokens: two here, the second with the first's last tokens as context)
  within TOL."""
  tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
  pairs = paired(runs, "oracle_rolling")
  assert len(pairs) == 10
  for hf, ours in pairs:
    assert WINDOW < len(tok.encode(hf["doc"]["page"])) <= 2 * WINDOW
    want, got = hf["resps"][0][0], ours["resps"][0][0]
    assert abs(want - got) < TOL, (hf["doc_id"], want, got)


def texts(out) -> dict[int, str]:
  """{doc_id: the generated text, cut at STOP} of the generation task."""
  return {i: s["filtered_resps"][0] for i, s in samples(out, "oracle_gen").items()}


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [BATCH, 1, 5])
def test_greedy_generations_are_the_same_strings(runs, checkpoint, tasks, batch_size):
  """Greedy text until STOP or 8 new tokens: the same string for every prompt,
  whatever loopjax's batch (its padding, the prompts sharing a batch)."""
  want = texts(runs["hf"])
  if batch_size == BATCH:
    got = texts(runs["loopjax"])
  else:
    args = f"pretrained={checkpoint}"
    got = texts(evaluate(tasks, ["oracle_gen"], "loopjax", args, batch_size))
  assert got == want
  assert any(t for t in want.values()), want  # text was generated
  assert any(len(t.split()) < 8 for t in want.values()), want  # and cut short
  assert not any(STOP in t for t in want.values()), want
