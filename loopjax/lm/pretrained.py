"""`--mode=analyze` on a pretrained model: `model.hf_dir` loaded (no
checkpoint, no training), prompts from `data.source=prompts:FILE`.

The model's config is the directory's (its family's mapping, `pretrained.load`)
with `model.num_loops` recurrences and `model.dtype`; `model.hf_split` places
a feedforward model's layers as prelude, core and coda. Outputs go to the
workdir, which records the config (a later run with another refuses it).
The model is placed on the run's mesh (all devices of all processes), each
batch of prompts split over it; process 0 writes.
"""

import json

from etils import epath

from loopjax import config as config_lib
from loopjax import halting, restore, sharding, storage
from loopjax.analysis import registry, stage_figures
from loopjax.errors import ConfigError
from loopjax.lm import analyze as analyze_lm
from loopjax.lm import answers, spec
from loopjax.lm import prompts as prompts_lib
from loopjax.pretrained import llama
from loopjax.pretrained.load import resolve
from loopjax.workdir import Workdir


def prepare(config, workdir):
  """(the opened model, task, prompts): the directory's config, tokenizer and
  prompts and the workdir checked, before any weight is read or anything
  compiles."""
  prompts = prompts_lib.read(config.data.source, config.data.text_field)
  if config.data.answer_field:
    prompts_lib.answers(config.data.source, config.data.answer_field)  # checked
    if not registry.shared(spec.ANALYSES, config_lib.analyses(config)):
      raise ConfigError(
        "data.answer_field: answers are scored beside the streamed analyses; "
        f"add one of {', '.join(spec.SHARED)} to analyze.names"
      )
  opened = restore.language_model(config)
  cfg = opened.cfg
  if config.data.answer_field and not 2 <= cfg.num_loops <= config.analyze.max_depth:
    raise ConfigError(
      "data.answer_field: each answer's statistics are read at R "
      f"({cfg.num_loops}), which must be 2 .. analyze.max_depth "
      f"({config.analyze.max_depth})"
    )
  task = prompts_lib.lm_data(config, opened.text.tokenizer_json, prompts)
  if "halting" in config_lib.analyses(config):
    for rule in halting.grid(config.analyze.halting):
      rule.check(cfg, "analyze.halting.criteria", opened.name)
  wd = Workdir(workdir)
  wd.check(config)
  wd.check_writable("", "analysis")
  return opened, task, prompts


def analyze(config, workdir) -> list[epath.Path]:
  """The LM analyses (fixed points, stages, attention, halting) of the loaded
  model on the prompts, to `analyze.max_depth` recurrences, under
  workdir/analysis; with `analyze.baseline_dir`, a feedforward model's stages
  on the same prompts beside them (analysis/baseline, stages_vs_baseline.png).
  Returns the paths process 0 wrote (other processes: none)."""
  baseline = _baseline_config(config)
  opened, task, prompts = prepare(config, workdir)
  base = baseline and restore.language_model(baseline)
  base_task = base and prompts_lib.lm_data(baseline, base.text.tokenizer_json, prompts)
  model = opened.model()  # every tensor checked: then the record
  writes = sharding.writes()
  workdir = storage.path(workdir)
  if writes:
    storage.write_whole(workdir / "config.json", config_lib.to_json(config))
  out = workdir / "analysis"
  field = config.data.answer_field
  golds = field and prompts_lib.answers(config.data.source, field)
  written = _run(config, opened.cfg, model, task, prompts, out, golds or None)
  if baseline is None:
    return written
  del model  # one model in memory at a time
  written += _run(
    baseline, base.cfg, base.model(), base_task, prompts, out / "baseline"
  )
  if not writes:
    return written
  looped, fed = (
    json.loads((d / "stages.json").read_text()) for d in (out, out / "baseline")
  )
  return written + stage_figures.compare(looped, fed, out)


def _over_base(config):
  """`config` as a mutable copy over base()'s fields."""
  out = config_lib.base()
  out.unlock()
  out.update(config.to_dict())
  return out


def _run(
  config, cfg, model, task, prompts, out: epath.Path, golds=None
) -> list[epath.Path]:
  """The analyses on the prompts; with `golds`, each prompt also answered
  and scored beside its statistics (`answers`)."""
  run_config = _over_base(config)
  run_config.model = cfg  # the directory's shapes, for the memory report
  feed = sharding.Feed.like(model.params, config.sharding.rules)
  probe = prompts_lib.batches(task, prompts, config.analyze.batch_size, feed)
  a, R = config.analyze, cfg.num_loops

  def scored(ex):
    stats = answers.per_question(ex, R, a.tol)
    return answers.score(
      model, task, prompts, golds, num_loops=R, tokens=a.answer_tokens,
      stats=stats, out_dir=out, batch_size=a.batch_size, feed=feed,
    )  # fmt: skip

  rows = scored if golds else None
  return analyze_lm.run(run_config, task, model, 0, out, probe, "prompts", rows)


def _baseline_config(config):
  """The config analyzing `analyze.baseline_dir` (None if unset): a Llama or
  OLMo 2 directory, once (R 1), its stages only; checked before any load."""
  path = config.analyze.baseline_dir
  if not path:
    return None
  if "stages" not in config_lib.analyses(config):
    raise ConfigError(
      "analyze.baseline_dir: compares stages; add 'stages' to analyze.names"
    )
  b = restore.pretrained_config(path, _over_base(config), hf_split="", num_loops=1)
  b.analyze.update(names=("stages",), max_depth=1, baseline_dir="")
  hf, family, *_ = resolve(path, b.model, weights=False)
  if family is not llama:
    raise ConfigError(
      f"analyze.baseline_dir: must be a feedforward Llama or OLMo 2 directory; "
      f"{path} holds model_type {hf.config['model_type']!r}"
    )
  return b
