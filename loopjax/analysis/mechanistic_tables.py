"""Markdown tables and one-line summaries of the mechanistic analyses (their
records: kg/analyses.py, lm/analyses.py; the figures: mechanistic_figures.py).

Each summary reads the run's main held-out split (`main_split` in the
report: OOD composition, or the deepest trained k); the tables cover every
split.
"""

import numpy as np

from loopjax.analysis.plots import markdown

# (what is looked for, where it is read)
LENS_PANELS = [(t, p) for t in ("bridge", "answer") for p in ("relation", "answer")]


def main_result(report: dict, name: str) -> tuple[str, dict]:
  """(split, result) of the run's main held-out split (else the first split)."""
  results = report[name]
  split = report.get("main_split")
  if split not in results:  # e.g. a report written before main_split existed
    split = next(iter(results))
  return split, results[split]


def _best(m_RL) -> tuple[float, int, int]:
  """(max, iteration, layer), 1-based."""
  m_RL = np.asarray(m_RL)
  r, l = np.unravel_index(int(m_RL.argmax()), m_RL.shape)
  return float(m_RL[r, l]), int(r) + 1, int(l) + 1


def lens_table(report: dict) -> str:
  """Per split and group of layers (the core's per iteration), each panel's
  best mean reciprocal rank, where, and at the last layer read."""
  head = [
    "split",
    "queries",
    *(f"{t} MRR at {p}: best (r, l) / last" for t, p in LENS_PANELS),
  ]
  out = []
  for split, lens in report["logit_lens"].items():
    for group in ("prelude", "core", "coda"):  # prelude / coda: r is "-"
      if group not in lens:
        continue
      cells = []
      for t, p in LENS_PANELS:
        mrr = np.atleast_2d(lens[group][t][p]["mrr"])  # prelude, coda: (1, layers)
        best, r, l = _best(mrr)
        at = f"({r}, {l})" if group == "core" else f"(-, {l})"
        cells.append(f"{best:.2f} {at} / {mrr[-1, -1]:.2f}")
      label = split if group == "core" else f"{split} ({group})"
      out.append([label, str(lens["examples"]), *cells])
  return markdown(head, out)


def lens_summary(report: dict) -> str:
  split, res = main_result(report, "logit_lens")
  if "core" not in res:
    return f"{split}: no inferred queries"
  b = _best(res["core"]["bridge"]["relation"]["mrr"])
  return (
    f"{split}: bridge MRR at the relation position up to {b[0]:.2f} "
    f"(iteration {b[1]}, layer {b[2]})"
  )


FIXED_POINTS_HEAD = [
  "split",
  "kind",
  "layer",
  "converged at",
  "converged share",
  "period",
  "read change below 1e-1 / 3e-2 / 1e-2 / 3e-3 / 1e-3 from",
  "within 1e-1 / ... / 1e-3 of the last iterate from (MECH)",
  "last change: read / raw / update / 1 - cos",
  "distance to other layers",
]


def fixed_points_table(report: dict) -> str:
  """Per split and layer: when it converges, the ladders, its last changes
  and how far its limit is from the other layers'."""
  out = []
  for split, fp in report["fixed_points"].items():
    for l, x in enumerate(fp["layers"]):
      last = [(x.get(k) or [np.nan])[-1] for k in ("change", "raw", "update")]
      last.append(1 - (x.get("cosine") or [np.nan])[-1])
      apart = [
        f"{fp['distance'][l][m]:.2f}" for m in range(len(fp["layers"])) if m != l
      ]
      out.append(
        [
          split,
          fp["kind"],
          str(l + 1),
          str(x["converged_at"] or "-"),
          f"{x['converged_share']:.2f}",
          str(x["period"] or "-"),
          ladder(x),
          ladder(x, "settled_at_tol"),
          " / ".join(f"{v:.1e}" for v in last),
          ", ".join(apart) or "-",
        ]
      )
  return markdown(FIXED_POINTS_HEAD, out)


def fixed_points_summary(report: dict) -> str:
  split, res = main_result(report, "fixed_points")
  return f"{split}: {res['kind']}; " + ", ".join(
    f"layer {l + 1} converges at {x['converged_at'] or 'never'}"
    for l, x in enumerate(res["layers"])
  )


ATTENTION_HEAD = [
  "split",
  "layer",
  "head",
  "ColSum C: iter 1 / last (uniform)",
  "top share: iter 1 / last (uniform)",
  "entropy (last)",
  "change (last)",
  "profile (last)",
]


def attention_table(report: dict) -> str:
  """Per split, layer and head: ColSum concentration and top share at the
  first and last iteration (uniform attention's beside), entropy, change and
  profile at the last."""
  out = []
  for split, att in report["attention"].items():
    top, ent = np.asarray(att["top_share"]), np.asarray(att["entropy"])
    tv, prof = np.asarray(att["stability"]), np.asarray(att["profile"])
    conc, base = np.asarray(att["concentration"]), att["uniform"]
    for l in range(top.shape[1]):
      for n in range(top.shape[2]):
        out.append(
          [
            split,
            str(l + 1),
            str(n + 1),
            f"{conc[0, l, n]:.2f} / {conc[-1, l, n]:.2f} ({base['concentration']:.2f})",
            f"{top[0, l, n]:.2f} / {top[-1, l, n]:.2f} ({base['top_share']:.2f})",
            f"{ent[-1, l, n]:.2f}",
            f"{tv[-1, l, n]:.1e}" if len(tv) else "-",
            _profile(prof[l, n]),
          ]
        )
  return markdown(ATTENTION_HEAD, out)


def attention_summary(report: dict) -> str:
  split, res = main_result(report, "attention")
  conc = np.asarray(res["concentration"])
  return (
    f"{split}: ColSum concentration, mean over heads, {conc[0].mean():.2f} at "
    f"iteration 1, {conc[-1].mean():.2f} at the last (uniform attention: "
    f"{res['uniform']['concentration']:.2f})"
  )


def activations_table(report: dict) -> str:
  """Per split and layer: the largest max / median ratio, where it sits and
  how often, and the ratio at the last iteration."""
  head = [
    "split",
    "layer",
    "max / median: largest (iteration)",
    "at (position, dim)",
    "share",
    "last iteration",
  ]
  out = []
  for split, act in report["activations"].items():
    ratio = np.asarray(act["ratio"])
    for l in range(ratio.shape[1]):
      r = int(ratio[:, l].argmax())
      out.append(
        [
          split,
          str(l + 1),
          f"{ratio[r, l]:.1f} ({r + 1})",
          f"({act['position'][r][l]}, {act['dim'][r][l]})",
          f"{act['share'][r][l]:.2f}",
          f"{ratio[-1, l]:.1f}",
        ]
      )
  return markdown(head, out)


def activations_summary(report: dict) -> str:
  split, res = main_result(report, "activations")
  return f"{split}: max/median |h| up to {np.asarray(res['ratio']).max():.1f}"


def fixed_cell(r: dict) -> str:
  """kind (converged at, per layer); the last layer's read change (median over
  tokens) from the last iteration to the one before."""
  conv = ", ".join(str(c or "-") for c in r["converged_at"])
  n = len(r["change"])  # entry n - 1: iteration n to n + 1
  return f"{r['kind']} ({conv}); {r['change'][-1]:.1e} at r = {n} -> {n + 1}"


def ladder(layer: dict, key: str = "converged_at_tol") -> str:
  """The iterations from which a layer's read change (or, `settled_at_tol`,
  its distance to the last iterate) stays below each LADDER tolerance."""
  return " / ".join(str(r or "-") for r in layer.get(key, {}).values())


def _profile(p_S) -> str:
  """The shares of the first keys (all of them up to PROFILE_KEYS)."""
  cut = " ..." if len(p_S) > PROFILE_KEYS else ""
  return " ".join(f"{x:.2f}" for x in p_S[:PROFILE_KEYS]) + cut


PROFILE_KEYS = 8
