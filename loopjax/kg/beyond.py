"""A depth-extrapolation run's held-out chains deeper than trained, against
step and inference depth: `plots/depths.png`, `plots/depths.md` and the
record they are drawn from, `plots/depths.json`.

LTG's claim is that a model trained on chains of up to K hops answers K + 1
to K + 4 given more iterations; a single accuracy at the training depth hides
it (K + 3 is at chance at R = 8 and at 0.5 from R = 10 in the `long` runs).
Each k is reported three ways (kg/depth.py): at the depth fixed before
training, where LTG's halting rule stops, and at the best evaluated depth (an
oracle, chosen on the test chains). The curves come from the evaluation job
that follows training (`--mode=eval --follow`: every `eval.depths`), or
else the training loop's evaluations. A run that keeps an EMA of its params
(train.param_ema) also gets `plots/depths_ema.{png,md,json}`: the same for
the average's evaluations (metrics `ema/...`, ema.py).
"""

import json

from etils import epath

from loopjax import ema, metrics, storage
from loopjax.analysis.plots import markdown, plt, save
from loopjax.kg import curriculum, depth
from loopjax.workdir import run_config

BEYOND = 4  # held-out chains to K + 4 hops, the range of LTG's claim


def depth_records(workdir: epath.Path) -> list[dict]:
  """The run's evaluations that hold several depths or the halting rule: the
  evaluation job's, or else the training loop's; [] if none."""
  for where in (workdir / "eval", workdir):
    if found := [r for r in metrics.read(where) if any("/acc@" in k for k in r)]:
      return found
  return []


def curves(records: list[dict], config, prefix: str = "eval/") -> dict:
  """{k: {R: {step: accuracy}}} for the held-out chains K + 1..K + 4 hops
  deep at every depth R the evaluations `records` hold (`prefix`: the raw
  params' metrics, or `ema.PREFIX` for their EMA's)."""
  K, R = config.data.train_hops, config.model.num_loops
  out = {}
  for k in range(K + 1, K + BEYOND + 1):
    key = f"{prefix}test_k{k}/acc"
    at = {R: key} | {
      int(d): name
      for name in records[-1]
      if name.startswith(key + "@") and (d := name.rpartition("@")[2]).isdigit()
    }
    by_depth = {
      d: {r["step"]: r[at[d]] for r in records if at[d] in r} for d in sorted(at)
    }
    if any(by_depth.values()):
      out[k] = by_depth
  return out


def rows(
  records: list[dict], config, found: dict, phases: dict, prefix: str = "eval/"
) -> list[dict]:
  """Per evaluated step: the stage and, per k, the accuracy at the fixed
  depth, by the halting rule (and its mean iterations), and the oracle's best
  over the evaluated depths (and its R; ties: the fewest iterations)."""
  fixed, halted = depth.fixed_depth(config), {r["step"]: r for r in records}
  out = []
  for step in sorted({s for d in found.values() for acc in d.values() for s in acc}):
    row = {"step": step, "stage": curriculum.stage_at(config, phases, step), "k": {}}
    for k, by_depth in found.items():
      at = [(acc[step], -d) for d, acc in by_depth.items() if step in acc]
      best, d = max(at, default=(None, 0))
      key = f"{prefix}test_k{k}/"
      row["k"][k] = {
        "fixed": by_depth.get(fixed, {}).get(step),
        "halt": halted[step].get(key + "acc@halt"),
        "iters": halted[step].get(key + "iters@halt"),
        "oracle": best,
        "oracle_R": -d if best is not None else None,
      }
    out.append(row)
  return out


def write(workdir: epath.Path, phases: dict, prefix: str = "eval/") -> list[epath.Path]:
  """`plots/depths.{png,md,json}` for a chains run evaluated beyond its
  trained hops, and `depths_ema.*` where it evaluated its params' EMA
  (`prefix` ema.PREFIX); nothing else."""
  records = depth_records(workdir)
  if not records:
    return []
  config = run_config(workdir)
  if not (found := curves(records, config, prefix)):
    return []
  stem = "depths" if prefix == "eval/" else "depths_ema"
  K, fixed = config.data.train_hops, depth.fixed_depth(config)
  table = rows(records, config, found, phases, prefix)
  png = _figure(workdir / "plots" / f"{stem}.png", K, found, table, phases)
  record = png.with_suffix(".json")
  halting = _thresholds(records, prefix)
  head = {"train_hops": K, "fixed_depth": fixed, "halting": halting}
  summary = held(table)
  storage.write_whole(
    record, json.dumps(head | {"held": summary, "rows": table}, indent=1)
  )
  md = png.with_suffix(".md")
  text = _intro(K, fixed, records, prefix) + _table(K, table)
  storage.write_whole(md, text + "\n" + _held_table(K, summary))
  averaged = write(workdir, phases, ema.PREFIX) if prefix == "eval/" else []
  return [png, md, record, *averaged]


def _thresholds(records: list[dict], prefix: str = "eval/") -> dict:
  """The halting rule's thresholds at each evaluated step (tuned per step)."""
  return {
    r["step"]: {t: r[f"{prefix}halting/{t}"] for t in ("eps", "tau")}
    for r in records
    if f"{prefix}halting/eps" in r
  }


def _intro(K: int, fixed: int, records: list[dict], prefix: str = "eval/") -> str:
  last = _thresholds(records, prefix)
  rule = "no halting recorded"
  if last:
    t = last[max(last)]
    rule = f"KL < {t['eps']:g} and entropy < {t['tau']:g} at the last evaluation"
  stem, whose = "depths", ""
  if prefix != "eval/":
    stem, whose = "depths_ema", "The EMA of the params (train.param_ema). "
  return (
    f"{whose}Held-out accuracy beyond the trained {K} hops (figure: {stem}.png; "
    f"record: {stem}.json), three ways: **fixed**, at R = {fixed} iterations "
    "set before training; **halt**, LTG's KL + entropy rule stopping each "
    f"chain on its own ({rule}; mean iterations in brackets); **oracle**, "
    "the best evaluated R, chosen on these test chains: an upper bound, not "
    "a result.\n\n"
  )


def _figure(path, K: int, found: dict, table: list[dict], phases: dict):
  """One panel per k, a line per depth and one for the halting rule, the
  curriculum's stages marked."""
  fig, axes = plt.subplots(
    1, len(found), figsize=(4.2 * len(found), 3.8), sharey=True, squeeze=False
  )
  for ax, (k, by_depth) in zip(axes[0], found.items(), strict=True):
    colors = plt.cm.viridis(
      [i / max(1, len(by_depth) - 1) for i in range(len(by_depth))]
    )
    for color, (d, acc) in zip(colors, by_depth.items(), strict=True):
      ax.plot(list(acc), list(acc.values()), "o-", ms=3, color=color, label=f"R = {d}")
    halt = [
      (r["step"], r["k"][k]["halt"]) for r in table if r["k"][k]["halt"] is not None
    ]
    if halt:
      ax.plot(*zip(*halt, strict=True), "k--", lw=1.5, label="halting")
    for phase, step in phases.items():
      ax.axvline(step, color="gray", ls=":", lw=1)
      ax.text(step, 1.02, phase, rotation=90, va="bottom", ha="center", fontsize=7)
    ax.set(xlabel="step", ylim=(0, 1.05))
    ax.set_title(f"k = {k} (K + {k - K})", pad=36)  # above the stages' labels
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("held-out accuracy")
  axes[0][-1].legend(fontsize=7)
  return save(fig, path)


def _table(K: int, table: list[dict]) -> str:
  """Per evaluated step: the stage, and per k fixed | halt (iters) | oracle (R)."""

  def cell(value, note=None, fmt="{:.3f}"):
    if value is None:
      return "-"
    return fmt.format(value) + (f" ({note})" if note is not None else "")

  head, body = ["step", "stage"], []
  for k in table[0]["k"] if table else ():
    head += [f"K + {k - K} fixed", f"K + {k - K} halt", f"K + {k - K} oracle"]
  for r in table:
    cells = [str(r["step"]), str(r["stage"])]
    for c in r["k"].values():
      iters = None if c["iters"] is None else f"{c['iters']:.1f}"
      oracle_R = None if c["oracle_R"] is None else f"R = {c['oracle_R']}"
      cells += [cell(c["fixed"]), cell(c["halt"], iters), cell(c["oracle"], oracle_R)]
    body.append(cells)
  return markdown(head, body)


WAYS = ("fixed", "halt", "oracle")


def held(table: list[dict], bar: float = 0.5) -> dict:
  """Per k and way (fixed, halt, oracle): whether the claim holds, not only
  whether it was glimpsed: the first step at >= `bar`, the share of the
  evaluations after it also >= `bar`, the longest run of consecutive
  evaluations >= `bar`, and the value at the last evaluation."""
  out = {}
  for k in table[0]["k"] if table else ():
    out[k] = {}
    for way in WAYS:
      series = [
        (r["step"], r["k"][k][way]) for r in table if r["k"][k][way] is not None
      ]
      hits = [v >= bar for _, v in series]
      first = hits.index(True) if True in hits else None
      after = hits[first + 1 :] if first is not None else []
      streak = run = 0
      for hit in hits:
        run = run + 1 if hit else 0
        streak = max(streak, run)
      out[k][way] = {
        "first": series[first][0] if first is not None else None,
        "after": [sum(after), len(after)],
        "streak": streak,
        "last": series[-1] if series else None,
      }
  return out


def _held_table(K: int, summary: dict) -> str:
  """`held` as a table: a row per k and way."""
  body = []
  for k, ways in summary.items():
    for way, h in ways.items():
      last = "-" if h["last"] is None else f"{h['last'][1]:.3f} (step {h['last'][0]})"
      first = "not reached" if h["first"] is None else str(h["first"])
      after = f"{h['after'][0]} of {h['after'][1]}" if h["first"] is not None else "-"
      body.append([f"K + {int(k) - K}", way, first, after, str(h["streak"]), last])
  head = ["k", "R", "first >= 0.5", "later >= 0.5", "longest run >= 0.5", "last"]
  return "Is it held? Per k and way of choosing R:\n\n" + markdown(head, body)
