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
is read. Where the choice is the harness's, the defaults are its `hf`
model's: `pretrained=` names the results folder, and add_bos_token unset
encodes as the tokenizer does (its post-processor: a Llama tokenizer adds
<s>). `python -m loopjax.lm_eval` runs it for a list of recurrences
into a workdir.

Several processes (`python -m loopjax.lm_eval` with the multi-process flags)
run one harness, not one rank each: the harness's ranks split the requests
and gather results through torch.distributed, while the model here spans
every process's devices and JAX runs a step only when every process calls it
with the same shapes. So each process builds the same requests (the tasks
and seeds are the same), every batch is scored by all devices together
(`scoring`), and process 0 alone writes the results.
"""

import contextlib
import inspect
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
from loopjax.errors import ConfigError, first_line
from loopjax.field_rules import ENUMS, MAX_ITERATIONS
from loopjax.halting import Rule
from loopjax.lm import scoring

MAX_GEN_TOKS = 256  # new tokens where a task does not say (the harness's hf model's)


def _count(name: str, value, least: int = 1):
  """`value` as an integer >= `least` (None stays None), else one line."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or value < least:
    raise ConfigError(
      f"model_args: {name} must be an integer >= {least}; got {value!r}"
    )
  return value


def _batch_size(value):
  """The harness's `--batch_size` is a string ("16", "auto", "auto:4"); "auto"
  gets the default (there is no memory probe)."""
  if isinstance(value, str) and value.startswith("auto"):
    return 8
  return int(value) if isinstance(value, str) and value.isdigit() else value


def _checked(args: dict) -> dict:
  """The model arguments that take a number, a dtype or a flag, checked (the
  harness parses `k=v` into int, float and bool where it can; what is left a
  string was not one)."""
  least = {"num_loops": 1, "batch_size": 1, "max_length": 2, "max_gen_toks": 1,
           "r_min": 1, "step": 0, "seed": 0}  # fmt: skip
  for name, n in least.items():
    _count(name, args[name], n)
  if (args["num_loops"] or 1) > MAX_ITERATIONS:
    raise ConfigError(
      f"model_args: num_loops must be <= {MAX_ITERATIONS} "
      f"(field_rules.MAX_ITERATIONS); got {args['num_loops']}"
    )
  if args["dtype"] not in ENUMS["model.dtype"]:
    raise ConfigError(
      f"model_args: dtype must be one of {', '.join(ENUMS['model.dtype'])}; "
      f"got {args['dtype']!r}"
    )
  if args["add_bos_token"] not in (None, True, False):
    raise ConfigError(
      f"model_args: add_bos_token must be True or False; got {args['add_bos_token']!r}"
    )
  t = args["threshold"]
  if t is not None and (isinstance(t, bool) or not isinstance(t, int | float)):
    raise ConfigError(f"model_args: threshold must be a number; got {t!r}")
  if args["pretrained"] is not None and args["hf_dir"] is not None:
    raise ConfigError("model_args: give pretrained= or hf_dir= (the same), not both")
  return args


@register_model("loopjax")
class LoopjaxLM(TemplateLM):
  """The harness's view of a `scoring.Scorer`."""

  def __init__(
    self,
    pretrained: str | None = None,
    hf_dir: str | None = None,
    workdir: str | None = None,
    step: int | None = None,
    num_loops: int | None = None,
    exit: str | None = None,
    threshold: float | None = None,
    r_min: int = 1,
    start: str = "uniform",
    batch_size: int | str = 8,
    dtype: str = "float32",
    max_length: int | None = None,
    max_gen_toks: int = MAX_GEN_TOKS,
    add_bos_token: bool | None = None,
    seed: int = 0,
    record: str | None = None,
    max_batch_size: int | None = None,  # the harness's, for batch_size=auto
    device: str | None = None,  # the harness's; JAX places the model
  ):
    super().__init__()
    batch_size = _batch_size(batch_size)
    _checked(locals())
    rule = Rule.exit(exit, threshold, r_min=r_min, start=start) if exit else None
    record = record and storage.path(record, "model_args: record")
    loaded = scoring.load(
      hf_dir=pretrained or hf_dir, workdir=workdir, step=step, num_loops=num_loops,
      dtype=dtype, max_length=max_length, batch_size=int(batch_size), exit=rule,
      seed=seed,
    )  # fmt: skip
    self._use(loaded, max_gen_toks, add_bos_token, record)

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
    scores = self.scorer.loglikelihood([(ctx, cont) for _, ctx, cont in requests])
    for (key, *_), s in zip(requests, scores, strict=True):
      self.cache_hook.add_partial("loglikelihood", key, (s.logprob, s.greedy))
    self._scores = scores  # for `loglikelihood`'s record: it has the requests
    return [(s.logprob, s.greedy) for s in scores]

  def loglikelihood(self, requests, disable_tqdm: bool = False):
    out = super().loglikelihood(requests, disable_tqdm)
    self._write(requests, "loglikelihood", [s.iterations for s in self._scores])
    return out

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
      f"--tasks: unknown task {unknown[0]!r} ({_why_unknown(unknown[0], include_path)})"
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
    with _data_on_disk():
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


@contextlib.contextmanager
def _data_on_disk():
  """A task's data set neither on disk nor reachable (offline mode, a cluster
  with no route to the hub: the datasets library raises ConnectionError) as
  one line saying what to do."""
  try:
    yield
  except ConnectionError as e:
    raise ConfigError(
      f"a task's data set is not on disk and cannot be downloaded here "
      f"({first_line(e, 160)}): download it where there is a network into "
      "HF_DATASETS_CACHE (or HF_HOME), then run with HF_DATASETS_OFFLINE=1"
    ) from None


def _why_unknown(task: str, include_path: str | None) -> str:
  """Where to look: a YAML file under include_path that names the task but
  does not load (the harness skips it without a word), or what lists tasks."""
  if not include_path:
    return "`lm_eval ls tasks` lists the harness's; local YAML tasks: --include_path"
  import yaml

  for path in sorted(Path(include_path).expanduser().rglob("*.yaml")):
    text = path.read_text(errors="replace")
    if path.stem != task and not re.search(
      rf"^task:\s*['\"]?{re.escape(task)}\b", text, re.M
    ):
      continue
    try:
      yaml.safe_load(text)
    except yaml.YAMLError as e:
      return f"{path} names it but does not load: {first_line(e, 160)}"
    return f"{path} names it but the harness does not read it as a task"
  return f"no YAML file under --include_path={include_path} names it"


def _flag(args: list[str], name: str) -> str | None:
  """The value of `--name V` or `--name=V` in a command line."""
  for i, a in enumerate(args):
    if a.startswith(name + "="):
      return a.split("=", 1)[1]
    if a == name and i + 1 < len(args):
      return args[i + 1]
  return None


def _precheck(args: list[str]) -> None:
  """`--model loopjax`'s arguments checked before the harness starts (and
  logs), with the constructor's own rules: one line for a bad one."""
  if _flag(args, "--model") != "loopjax":
    return
  given = utils.simple_parse_args_string(_flag(args, "--model_args") or "")
  params = dict(inspect.signature(LoopjaxLM.__init__).parameters)
  params.pop("self")
  if unknown := [k for k in given if k not in params]:
    raise ConfigError(
      f"--model_args: unknown argument {unknown[0]!r} (loopjax takes "
      f"{', '.join(params)})"
    )
  merged = {k: p.default for k, p in params.items()} | given
  if "batch_size" not in given and (flag := _flag(args, "--batch_size")):
    merged["batch_size"] = flag  # the harness's own flag: a string
  _checked(merged | {"batch_size": _batch_size(merged["batch_size"])})


def main(argv):
  """The harness's command line (`argv`, the program first) with `loopjax`
  registered; bad model arguments are a ConfigError (`cli.run`: one line)."""
  from lm_eval.__main__ import cli_evaluate

  args = argv[1:]
  # hf_dir= is pretrained= (the name the harness's results folder is made from)
  args = [re.sub(r"(^|[,=])hf_dir=", r"\1pretrained=", a) for a in args]
  sys.argv = [argv[0], *args]
  _precheck(args)
  with _data_on_disk():
    cli_evaluate()


if __name__ == "__main__":
  cli.run(main, own_flags=True)
