"""What a language-model run adds to `--mode=report` (report.Parts; lm/spec
names it): `plots/lm.png`, training and validation loss against step beside
the unigram baseline and validation loss by number of iterations at
evaluations along the run; validation loss, unigram loss and perplexity in
results.md; a sweep's `lm_study.md` (study.py)."""

from etils import epath

from loopjax import metrics, report
from loopjax.analysis.plots import plt, save
from loopjax.lm import study
from loopjax.workdir import run_config

LOSS = "eval/validation/loss"


def plot(workdir: epath.Path) -> epath.Path:
  records = metrics.read(workdir)
  train = [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]
  evals = [r for r in records if LOSS in r]
  R = run_config(workdir).model.num_loops  # read before a figure is open
  fig, (ax, by_r) = plt.subplots(1, 2, figsize=(11, 4))
  if train:
    ax.plot(*zip(*train, strict=True), label="train", alpha=0.6)
  if evals:
    steps = [r["step"] for r in evals]
    ax.plot(steps, [r[LOSS] for r in evals], "o-", label="validation")
    if (unigram := evals[-1].get("eval/validation/unigram_loss")) is not None:
      ax.axhline(unigram, color="gray", ls="--", label="unigram")
  ax.set(xscale="log", xlabel="step", ylabel="loss (nats / token)", title=workdir.name)
  picks = (
    evals if len(evals) <= 4 else [evals[i * (len(evals) - 1) // 3] for i in range(4)]
  )
  for r in picks:
    d = sorted(int(k.rpartition("@")[2]) for k in r if k.startswith(LOSS + "@"))
    depths = sorted([*d, R])
    losses = [r[LOSS] if x == R else r[f"{LOSS}@{x}"] for x in depths]
    by_r.plot(depths, losses, "o-", label=f"step {r['step']}")
  by_r.axvline(R, color="gray", ls=":", lw=1)
  by_r.set(
    xlabel="iterations R at evaluation",
    ylabel="validation loss",
    title=f"trained at R = {R}",
  )
  for a in (ax, by_r):
    a.grid(alpha=0.3)
    if a.get_legend_handles_labels()[0]:
      a.legend(fontsize=8)
  return save(fig, workdir / "plots" / "lm.png")


def final(records: list[dict], evals: list[dict]) -> tuple[list[dict], tuple]:
  """The validation loss beside the unigram baseline, and the perplexity."""
  if lm := [r for r in records if LOSS in r]:
    return lm, ("validation/loss", "validation/unigram_loss", "validation/ppl")
  return evals, ()


PARTS = report.Parts(
  claims=lambda records: any(LOSS in r for r in records),
  plots=lambda workdir: [plot(workdir)],
  final=final,
  sweep=study.write,
)
