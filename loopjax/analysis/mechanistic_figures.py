"""Figures of the mechanistic analyses (their records: kg/analyses.py,
lm/analyses.py; their tables and summaries: mechanistic_tables.py).

Each figure shows the run's main held-out split (`main_split` in the report:
OOD composition, or the deepest trained k); the tables cover every split.
"""

import numpy as np
from etils import epath

from loopjax.analysis.mechanistic_tables import LENS_PANELS, PROFILE_KEYS, main_result
from loopjax.analysis.plots import plt, save

# The phases figure shows the two lens panels where composition shows up: the
# bridge at the relation, the answer at the answer.
LENS_KEY_PANELS = [("bridge", "relation"), ("answer", "answer")]


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
