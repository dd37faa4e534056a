"""A language model's analyses: fixed points, stages of inference and
attention, from one streamed pass over validation windows (`depth_scan`),
and the halting table from its own passes; each a record found by name
(lm/spec.py's ANALYSES, records in lm/analyses.py).

`analyze.lm_windows` rows of validation text (documents held out whole),
drawn as training draws its rows (`data.align`), are run to `analyze.max_depth`
iterations, `analyze.batch_size` windows at a time. Writes `fixed_points`,
`stages` and `attention` as .json, .md and .png; `stages.json` also records
the pass's compiled memory next to what stacking every attention weight
would take.
"""

import dataclasses
import functools

import jax
import numpy as np
from etils import epath

from loopjax import config as config_lib
from loopjax import sharding
from loopjax.analysis import depth_scan, registry
from loopjax.analysis.record import Inputs
from loopjax.errors import ConfigError
from loopjax.lm import spec
from loopjax.state import Model, eval_key

SPLIT = "validation"


def batches(task, num_windows: int, batch_size: int, feed=None):
  """(batches, n): the first n rows of validation text, drawn as training
  draws its rows (`data.align`: each starting at <bos>), the last batch
  filled by repeating rows (cut from the results: the first n rows count);
  `feed`: the model's (`sharding.Feed`, which splits each batch), or none."""
  feed = feed or sharding.Feed(None, ())
  n = min(num_windows, task.num_windows(SPLIT))
  if n == 0:
    raise ConfigError(
      f"data.valid_fraction: the validation split holds no window of "
      f"{task.seq_len} tokens to analyze"
    )
  B = feed.size(batch_size, n)
  out = []
  for i in range(0, n, B):
    batch = task.windows(SPLIT, np.resize(np.arange(i, min(i + B, n)), B))
    batch["real"] = np.ones(batch["inputs"].shape, bool)
    out.append(feed.put(batch))
  return out, n


@functools.partial(jax.jit, static_argnames=("depth",))
def _scan(weights: Model, batch, key, *, depth: int):
  return depth_scan.run(weights.module(), batch, depth, key)


def memory(compiled, batch, depth: int, model_cfg) -> dict:
  """The compiled pass's temporary and output bytes, and the float32 bytes of
  one iteration's and of all iterations' attention weights for this batch."""
  stats = compiled.memory_analysis()
  B, T = batch["inputs"].shape
  one = model_cfg.num_layers * B * model_cfg.num_heads * T * T * 4
  return {
    "batch": [B, T],
    "iterations": depth,
    "temp_bytes": int(stats.temp_size_in_bytes),
    "output_bytes": int(stats.output_size_in_bytes),
    "attention_one_iteration_bytes": one,
    "attention_all_iterations_bytes": one * depth,
  }


def run(
  config, task, model: Model, step: int, out_dir, probe=None, split=SPLIT, rows=None
) -> list[epath.Path]:
  """The LM analyses of `model` (the checkpoint at `step`) under `out_dir`;
  `probe`: (batches, n) to analyze instead of validation windows, reported
  as `split` (a pretrained model's prompts, run as they come); `rows`: called
  with the streamed pass's per-row outputs, returns the paths it wrote. Every
  process computes (the model may span them all); process 0 writes, and
  returns the paths."""
  a, out_dir, names = config.analyze, epath.Path(out_dir), config_lib.analyses(config)
  writes = sharding.writes()
  if writes:
    out_dir.mkdir(parents=True, exist_ok=True)
  key, depth = eval_key(config), a.max_depth
  feed = sharding.Feed.like(model.params, config.sharding.rules)
  probe, n = probe or batches(task, a.lm_windows, a.batch_size, feed)
  head = {
    "step": step,
    "fingerprint": task.fingerprint,
    "train_depths": [config.model.num_loops],
    "main_split": split,
    "windows": n,
    "seq_len": int(probe[0]["inputs"].shape[1]),
  }
  records = {x: registry.record(spec.ANALYSES, x) for x in names}
  shared, written = registry.shared(spec.ANALYSES, names), []
  inputs = Inputs(config, key, task, batches=probe, n=n)
  for name in (x for x in names if x not in shared):  # their own passes first
    result = records[name].compute(model, inputs)
    report = head | {name: {split: result}}
    written += records[name].write(name, report, out_dir) if writes else []
  if not shared:
    return written
  compiled = _scan.lower(model, probe[0], key, depth=depth).compile()
  mem = memory(compiled, probe[0], depth, config.model)
  outs = sharding.host([compiled(model, b, key) for b in probe])
  ex = jax.tree.map(lambda *o: np.concatenate(o, 0)[:n], *outs)
  summed = dataclasses.replace(inputs, memory=mem)
  for name in shared:
    report = head | {name: {split: records[name].summarize(ex, summed)}}
    written += records[name].write(name, report, out_dir) if writes else []
  return written + (rows(ex) if rows else [])
