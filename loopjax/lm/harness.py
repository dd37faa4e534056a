"""lm-evaluation-harness's model `loopjax`: a pretrained looped model
(`hf_dir=DIR`) or a loopjax run's checkpoint (`workdir=DIR`) scored at a
chosen number of recurrences and exit rule (the `loopjax[lm_eval]` extra).

  python -m loopjax.lm.harness --model loopjax \
      --model_args hf_dir=~/models/huginn-0125,num_loops=32,dtype=bfloat16 \
      --tasks arc_easy,hellaswag --batch_size 16

is the harness's own command line (any of its flags) with the model
registered: the harness finds third-party models only when their module is
imported. Model arguments: pretrained (or hf_dir) or workdir (with step),
num_loops, exit (a halting criterion) and threshold, r_min, start, dtype,
max_length, max_gen_toks, add_bos_token, batch_size, seed, record (a JSONL
file that gets each request's recurrences); each is checked before a weight
is read (harness_args.py). `--batch_size auto` is 8: there is no memory
probe, and the run says so. A hub that cannot be reached makes the run read
data sets from disk only (harness_hub.py): one line, not a minute of
retries, when one is missing. Where the choice is the harness's, the
defaults are its `hf` model's: `pretrained=` names the results folder, and
add_bos_token unset encodes as the tokenizer does (its post-processor: a
Llama tokenizer adds <s>). `python -m loopjax.lm_eval` runs it for a list of recurrences
into a workdir.

Several processes (`python -m loopjax.lm_eval` with the multi-process flags)
run one harness, not one rank each: the harness's ranks split the requests
and gather results through torch.distributed, while the model here spans
every process's devices and JAX runs a step only when every process calls it
with the same shapes. So each process builds the same requests (the tasks
and seeds are the same), every batch is scored by all devices together
(`scoring`), and process 0 alone writes the results.
"""

import json
import re
import sys
from pathlib import Path

import jinja2
import jinja2.sandbox
import lm_eval.models  # noqa: F401  the harness's own models, registered first
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from loopjax import cli, sharding, storage
from loopjax.errors import ConfigError
from loopjax.halting import Rule
from loopjax.lm import scoring
from loopjax.lm.harness_args import MAX_GEN_TOKS, ModelArgs, precheck
from loopjax.lm.harness_hub import data_on_disk, why_unknown


class Scored(list):
  """(log-probability, greedy) per request, as the harness reads them, with
  the recurrences each used: returned through TemplateLM's `loglikelihood`,
  which knows only the list."""

  def __init__(self, pairs, iterations):
    super().__init__(pairs)
    self.iterations = iterations


@register_model("loopjax")
class LoopjaxLM(TemplateLM):
  """The harness's view of a `scoring.Scorer`."""

  def __init__(self, **model_args):
    """From the harness's `--model_args` (harness_args.ModelArgs: each
    checked before a weight is read; an unknown one is a TypeError)."""
    super().__init__()
    args = ModelArgs(**model_args)
    rule = None
    if args.exit:
      rule = Rule.exit(args.exit, args.threshold, r_min=args.r_min, start=args.start)
    record = args.record and storage.path(args.record, "model_args: record")
    loaded = scoring.load(
      hf_dir=args.model_dir, workdir=args.workdir, step=args.step,
      num_loops=args.num_loops, dtype=args.dtype, max_length=args.max_length,
      batch_size=args.batch_size, exit=rule, seed=args.seed,
    )  # fmt: skip
    self._use(loaded, args.max_gen_toks, args.add_bos_token, record)

  @classmethod
  def of(cls, loaded: scoring.Loaded) -> "LoopjaxLM":
    """The harness's model around an opened one (`run`: from a config), with
    the constructor's defaults."""
    self = cls.__new__(cls)
    TemplateLM.__init__(self)
    self._use(loaded)
    return self

  def _use(self, loaded, max_gen_toks=MAX_GEN_TOKS, add_bos_token=None, record=None):
    """What both constructors set: the scorer and how text reaches it."""
    self.scorer, self.name = loaded.scorer, loaded.name
    self.max_gen_toks, self.add_bos_token = max_gen_toks, add_bos_token
    # <bos> as text (a chat template writes it): not added twice
    prefix = self.scorer.tok.decode([self.scorer.start_id], skip_special_tokens=False)
    self.bos_text = prefix or None
    self.template, self.specials = loaded.chat_template, loaded.specials
    if self.template is not None:
      self.apply_chat_template([{"role": "user", "content": "2 + 2?"}])  # renders?
    self.record = record

  # --- what TemplateLM asks of a model ----------------------------------------

  @property
  def eot_token_id(self) -> int:
    return self.scorer.eos_id

  @property
  def prefix_token_id(self) -> int:
    return self.scorer.start_id

  @property
  def tokenizer_name(self) -> str:
    return self.name.rstrip("/").replace("/", "__")

  @classmethod
  def create_from_arg_string(cls, arg_string: str, additional_config=None):
    """The harness's constructor from `--model_args`; an argument given there
    (batch_size) wins over the one the harness's own flags always pass."""
    return cls.create_from_arg_obj(
      utils.simple_parse_args_string(arg_string), additional_config
    )

  @classmethod
  def create_from_arg_obj(cls, arg_dict: dict, additional_config=None):
    """The same from a parsed `--model_args` (the harness's command line)."""
    extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
    return cls(**(extra | arg_dict))

  def tok_encode(self, string: str, add_special_tokens=None, **kw) -> list[int]:
    """`string`'s ids: after <bos> where asked (None: `add_bos_token`), and
    where neither says, as the tokenizer's post-processor makes them (the
    `hf` model's rule, including no second <bos> before a text that starts
    with one)."""
    bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
    if (
      add_special_tokens is None and self.bos_text and string.startswith(self.bos_text)
    ):
      bos = False
    if bos is None:
      return self.scorer.encode(string, special=True)
    ids = self.scorer.encode(string)
    return [self.scorer.start_id] + ids if bos else ids

  def tok_decode(self, ids, **kw) -> str:
    return self.scorer.decode(ids)

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    return self.template if chat_template is not False else None

  def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
    """tokenizer_config.json's template, rendered as transformers renders it."""
    if self.template is None:
      raise ConfigError(
        f"--apply_chat_template: {self.name} has no chat_template in "
        "tokenizer_config.json"
      )
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True
    )

    def raise_exception(message):
      raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    try:
      return env.from_string(self.template).render(
        messages=chat_history,
        add_generation_prompt=add_generation_prompt,
        **self.specials,
      )
    except jinja2.TemplateError as e:
      raise ConfigError(
        f"{self.name}/tokenizer_config.json: its chat_template does not render "
        f"({type(e).__name__}: {e})"
      ) from None

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
    """(log-probability, greedy) per tokenized request, as the harness asks;
    the list also carries each one's recurrences (`Scored`), which
    `loglikelihood` records."""
    scores = self.scorer.loglikelihood([(ctx, cont) for _, ctx, cont in requests])
    for (key, *_), s in zip(requests, scores, strict=True):
      self.cache_hook.add_partial("loglikelihood", key, (s.logprob, s.greedy))
    pairs = [(s.logprob, s.greedy) for s in scores]
    return Scored(pairs, [s.iterations for s in scores])

  def loglikelihood(self, requests, disable_tqdm: bool = False):
    """The harness's tokenization (TemplateLM's), then `_loglikelihood_tokens`;
    each request's recurrences recorded."""
    out = super().loglikelihood(requests, disable_tqdm)
    self._write(requests, "loglikelihood", out.iterations)
    return list(out)

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
    """A whole text's log-likelihood, in windows of `max_length` tokens
    (the harness's own windowing)."""
    windows, owner = [], []  # every text's windows, scored in one call
    for i, (text,) in enumerate(r.args for r in requests):
      for w in utils.get_rolling_token_windows(
        self.tok_encode(text), self.prefix_token_id, self.scorer.max_length, 1
      ):
        windows.append(utils.make_disjoint_window(w))
        owner.append(i)
    scores = self.scorer.loglikelihood(windows)
    out, used, count = [0.0] * len(requests), [0.0] * len(requests), [0] * len(requests)
    for i, s in zip(owner, scores, strict=True):
      out[i] += s.logprob
      used[i] += s.iterations
      count[i] += 1
    used = [u / max(c, 1) for u, c in zip(used, count, strict=True)]
    self._write(requests, "loglikelihood_rolling", used)
    return out

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Requests grouped by their generation arguments, each group batched."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
      kw = json.dumps(r.args[1], sort_keys=True, default=str)
      groups.setdefault(kw, []).append(i)
    texts, used = [None] * len(requests), [None] * len(requests)
    for key, idx in groups.items():
      kw = json.loads(key)
      until = kw.get("until") or []
      until = [until] if isinstance(until, str) else list(until)
      contexts = [self.tok_encode(requests[i].args[0]) for i in idx]
      done = self.scorer.generate(
        contexts,
        until,
        int(kw.get("max_gen_toks", self.max_gen_toks)),
        float(kw.get("temperature", 1.0)) if kw.get("do_sample") else 0.0,
      )
      for i, (text, iters) in zip(idx, done, strict=True):
        texts[i], used[i] = text, iters
    self._write(requests, "generate_until", used)
    return texts

  # ---------------------------------------------------------------------------

  def _write(self, requests, kind: str, iterations: list) -> None:
    """Each request's recurrences (a mean over scored tokens, or one per new
    token), added to the end of `record`: the file is rewritten whole, as an
    append on a bucket would replace the object."""
    if self.record is None or not sharding.writes():  # one writer
      return
    lines = [
      {"task": r.task_name, "doc_id": r.doc_id, "idx": r.idx}
      | {"request": kind, "iterations": iters}
      for r, iters in zip(requests, iterations, strict=True)
    ]
    self.record.parent.mkdir(parents=True, exist_ok=True)
    old = self.record.read_text() if self.record.exists() else ""
    new = "".join(json.dumps(line) + "\n" for line in lines)
    storage.write_whole(self.record, old + new)


def run(
  config,
  workdir,
  *,
  tasks,
  recurrences=(),
  exit=None,
  threshold=None,
  step=None,
  batch_size=8,
  include_path=None,
  **harness_kw,
):
  """`python -m loopjax.lm_eval`: the harness's `tasks` at each of `recurrences`
  (default: the config's R) on the model `config` opens (a pretrained
  directory, or the run in `workdir` at `step`: `restore.language_model`);
  results under workdir/lm_eval (r{R}.json, each request's recurrences in
  requests_r{R}.jsonl, table.md). `harness_kw`:
  num_fewshot, limit, apply_chat_template (`simple_evaluate`'s)."""
  from lm_eval import simple_evaluate
  from lm_eval.tasks import TaskManager

  if include_path and not Path(include_path).expanduser().is_dir():
    raise ConfigError(f"--include_path={include_path}: no such directory")
  manager = TaskManager(include_path=include_path or None)
  unknown = [t for t in tasks if t not in manager.all_tasks]
  if not tasks:
    raise ConfigError("--tasks: none given")
  if unknown:
    raise ConfigError(
      f"--tasks: unknown task {unknown[0]!r} ({why_unknown(unknown[0], include_path)})"
    )
  out = storage.path(workdir) / "lm_eval"
  rule = Rule.exit(exit, threshold) if exit else None
  model = LoopjaxLM.of(
    scoring.opened(config, workdir, step=step, exit=rule, batch_size=batch_size)
  )
  Rs = list(recurrences or (model.scorer.num_loops,))
  model.scorer.depths = tuple(sorted(set(Rs)))  # log-likelihoods: one pass
  table, writes = {}, sharding.writes()
  for R in Rs:
    model.scorer.num_loops, model.record = R, out / f"requests_r{R}.jsonl"
    if writes:
      model.record.unlink(missing_ok=True)
    with data_on_disk():
      results = simple_evaluate(
        model=model, tasks=list(tasks), task_manager=manager, **harness_kw
      )
    if writes:
      out.mkdir(parents=True, exist_ok=True)
      storage.write_whole(
        out / f"r{R}.json", json.dumps(results["results"], indent=1, default=str) + "\n"
      )
    for task, metrics in results["results"].items():
      for name, value in metrics.items():
        if isinstance(value, float) and "stderr" not in name:
          table.setdefault((task, name), {})[R] = value
  lines = [
    "| task | metric | " + " | ".join(f"r = {R}" for R in Rs) + " |",
    "|---|---|" + "---|" * len(Rs),
  ] + [
    f"| {t} | {m} | " + " | ".join(f"{v.get(R, float('nan')):.4f}" for R in Rs) + " |"
    for (t, m), v in table.items()
  ]
  if writes:
    storage.write_whole(out / "table.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
  return out


def main(argv):
  """The harness's command line (`argv`, the program first) with `loopjax`
  registered; bad model arguments are a ConfigError (`cli.run`: one line)."""
  from lm_eval.__main__ import cli_evaluate

  args = argv[1:]
  # hf_dir= is pretrained= (the name the harness's results folder is made from)
  args = [re.sub(r"(^|[,=])hf_dir=", r"\1pretrained=", a) for a in args]
  sys.argv = [argv[0], *args]
  precheck(args)
  with data_on_disk():
    cli_evaluate()


if __name__ == "__main__":
  cli.run(main, own_flags=True)
