"""Figures, markdown tables and one-line summaries of the mechanistic analyses
(their records: kg/analyses.py, lm/analyses.py).

Each figure shows the run's main held-out split (`main_split` in the report:
OOD composition, or the deepest trained k); the tables cover every split.
"""

import numpy as np
from etils import epath

from loopjax.analysis.plots import markdown, plt, save

# (what is looked for, where it is read); the phases figure shows the two where
# composition shows up: the bridge at the relation, the answer at the answer.
LENS_PANELS = [(t, p) for t in ("bridge", "answer") for p in ("relation", "answer")]
LENS_KEY_PANELS = [("bridge", "relation"), ("answer", "answer")]


def main_result(report: dict, name: str) -> tuple[str, dict]:
  """(split, result) of the run's main held-out split (else the first split)."""
  results = report[name]
  split = report.get("main_split")
  if split not in results:  # e.g. a report written before main_split existed
    split = next(iter(results))
  return split, results[split]


def _heatmap(ax, m_RL, title, vmax=1.0):
  m_RL = np.asarray(m_RL)
  im = ax.imshow(m_RL, aspect="auto", origin="lower", vmin=0, vmax=vmax, cmap="magma")
  R, L = m_RL.shape
  ax.set_xticks(range(L), [str(x + 1) for x in range(L)])
  ax.set_yticks(*_ticks(R))
  ax.set_xlabel("layer")
  ax.set_title(title, fontsize=9)
  return im


def _ticks(R: int):
  r = [x for x in (1, 2, 4, 8, 16, 32, 64, 128) if x <= R]
  return [x - 1 for x in r], [str(x) for x in r]


def logit_lens(report: dict, out_dir: epath.Path) -> list[epath.Path]:
  """Mean reciprocal rank of the bridge and of the answer, read at the first
  relation's position and at the answer position, per iteration x layer; with
  the grokking phases', the same across them (`lens_phases`)."""
  split, lens = main_result(report, "logit_lens")
  fig, axes = plt.subplots(1, 4, figsize=(14, 4.2), layout="constrained")
  axes[0].set_ylabel("iteration")
  if "core" in lens:
    for ax, (t, p) in zip(axes, LENS_PANELS, strict=True):
      im = _heatmap(ax, lens["core"][t][p]["mrr"], f"{t} at the {p} position")
    fig.colorbar(im, ax=axes, shrink=0.8, label="mean reciprocal rank")
  fig.suptitle(
    f"logit lens, {split} ({lens['examples']} queries), step {report['step']}"
  )
  paths = [save(fig, out_dir / "logit_lens.png", tight=False)]
  if report.get("phases"):
    paths.append(lens_phases(report, out_dir / "logit_lens_phases.png"))
  return paths


def lens_phases(report: dict, path: epath.Path) -> epath.Path:
  """Bridge MRR at the relation position and answer MRR at the answer position
  after each iteration (last core layer), one line per grokking phase."""
  split = report["main_split"]
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  cmap = plt.get_cmap("viridis")
  phases = [p for p in report["phases"] if "core" in p["logit_lens"].get(split, {})]
  for i, ph in enumerate(phases):
    core = ph["logit_lens"][split]["core"]
    for ax, (t, p) in zip(axes, LENS_KEY_PANELS, strict=True):
      mrr_R = np.asarray(core[t][p]["mrr"])[:, -1]
      ax.plot(
        np.arange(1, len(mrr_R) + 1),
        mrr_R,
        color=cmap(i / max(len(phases) - 1, 1)),
        label=f"{ph['phase']} (step {ph['step']})",
      )
      ax.set_title(f"{t} at the {p} position", fontsize=9)
  for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reciprocal rank (last layer)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.suptitle(f"logit lens across the grokking phases, {split}")
  return save(fig, path)


def fixed_points(report: dict, out_dir: epath.Path) -> list[epath.Path]:
  """Per layer, against iterations (log scales): the change of what the next
  layer reads (median over tokens, band to the 90th percentile) beside the
  raw residual-stream change; the change of the update and 1 - cosine; and
  the distance between the layers' limit directions."""
  split, fp = main_result(report, "fixed_points")
  fig, axes = plt.subplots(1, 3, figsize=(15, 4), width_ratios=(2, 2, 1))
  for l, layer in enumerate(fp["layers"]):
    change = np.asarray(layer["change"])
    r = np.arange(1, len(change) + 1)
    (line,) = axes[0].plot(r, change, label=f"layer {l + 1}: read state")
    axes[0].fill_between(
      r, change, layer["change_p90"], color=line.get_color(), alpha=0.15
    )
    axes[0].plot(
      r,
      layer["raw"],
      color=line.get_color(),
      ls="--",
      lw=1,
      label=f"layer {l + 1}: raw stream",
    )
    update = np.asarray(layer["update"])
    axes[1].plot(
      np.arange(2, len(update) + 2),
      update,
      color=line.get_color(),
      label=f"layer {l + 1}: update change",
    )
    axes[1].plot(
      r,
      1 - np.asarray(layer["cosine"]),
      color=line.get_color(),
      ls=":",
      label=f"layer {l + 1}: 1 - cosine",
    )
    if "to_last" in layer:  # MECH's: how far from the last iterate analyzed
      axes[0].plot(
        r + 1,
        layer["to_last"],
        color=line.get_color(),
        ls="-.",
        lw=1,
        label=f"layer {l + 1}: distance to the last iterate",
      )
  axes[0].axhline(fp["tol"], color="gray", ls=":", lw=1)  # the verdict's metric
  for ax in axes[:2]:
    for d in report["train_depths"]:
      ax.axvline(d, color="gray", ls="--", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("iteration r (dashed: training depth)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("relative change, iteration r to r + 1 (dotted: tol)")
  axes[1].set_ylabel("||delta(r) - delta(r-1)|| / ||delta(r-1)||;  1 - cos")
  dist_LL = np.asarray(fp["distance"])
  im = axes[2].imshow(dist_LL, vmin=0, cmap="magma")
  axes[2].set_title(f"distance of limit directions (margin {fp['margin']})", fontsize=9)
  layers = [str(x + 1) for x in range(len(dist_LL))]
  axes[2].set_xticks(range(len(dist_LL)), layers)
  axes[2].set_yticks(range(len(dist_LL)), layers)
  axes[2].set_xlabel("layer")
  fig.colorbar(im, ax=axes[2], shrink=0.8)
  fig.suptitle(
    f"fixed points ({fp['kind']}; {fp['share']:.0%} of {fp['tokens']} tokens "
    f"below {fp['tol']}), {split}, step {report['step']}"
  )
  return [save(fig, out_dir / "fixed_points.png")]


def attention(report: dict, out_dir: epath.Path) -> list[epath.Path]:
  """Per layer and head: ColSum concentration (uniform attention's dashed) and
  pattern change per iteration; the normalized column sums at the last
  iteration."""
  split, att = main_result(report, "attention")
  top_RLN, tv_RLN = np.asarray(att["concentration"]), np.asarray(att["stability"])
  profile_LNS = np.asarray(att["profile"])
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  L, N = top_RLN.shape[1:]
  for l in range(L):
    for n in range(N):
      label = f"L{l + 1}H{n + 1}"
      axes[0].plot(np.arange(1, len(top_RLN) + 1), top_RLN[:, l, n], label=label)
      axes[1].plot(np.arange(2, len(tv_RLN) + 2), tv_RLN[:, l, n], label=label)
  axes[0].axhline(att["uniform"]["concentration"], color="k", ls="--", lw=1)
  axes[0].set_ylabel("ColSum concentration (dashed: uniform)")
  axes[1].set_ylabel("total variation vs previous iteration")
  axes[1].set_yscale("log")
  for ax in axes[:2]:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=7, ncol=2)
  S = profile_LNS.shape[-1]
  heads = [(l, n) for l in range(L) for n in range(N)]
  if S > PROFILE_KEYS:  # text: one line per head over key positions
    for l, n in heads:
      axes[2].plot(np.arange(S), profile_LNS[l, n], lw=1, label=f"L{l + 1}H{n + 1}")
    axes[2].set_yscale("log")
  else:
    width = 0.8 / len(heads)
    for i, (l, n) in enumerate(heads):
      axes[2].bar(
        np.arange(S) + i * width, profile_LNS[l, n], width, label=f"L{l + 1}H{n + 1}"
      )
    axes[2].set_xticks(np.arange(S) + 0.4 - width / 2, [str(s) for s in range(S)])
  axes[2].set_xlabel("key position")
  axes[2].set_ylabel("share of attention mass (last iteration)")
  fig.suptitle(f"attention, {split}, step {report['step']}")
  return [save(fig, out_dir / "attention.png")]


def activations(report: dict, out_dir: epath.Path) -> list[epath.Path]:
  """Largest |activation| over the median, per iteration and layer."""
  split, act = main_result(report, "activations")
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for key, ax in (("ratio", axes[0]), ("max", axes[1])):
    m_RL = np.asarray(act[key])
    for l in range(m_RL.shape[1]):
      ax.plot(np.arange(1, len(m_RL) + 1), m_RL[:, l], label=f"layer {l + 1}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("max |h| / median |h|")
  axes[1].set_ylabel("max |h|")
  axes[0].legend(fontsize=8)
  fig.suptitle(f"activation magnitudes, {split}, step {report['step']}")
  return [save(fig, out_dir / "activations.png")]


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
