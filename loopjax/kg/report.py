"""What a knowledge-graph run adds to `--mode=report` (report.Parts; the
composition and chains Specs name it): accuracy curves per probe split,
composition's grokking phases first in results.md, chains' held-out hops and
the depths beyond training (beyond.py), and a sweep's ablations table
(ablations.py)."""

from loopjax import report
from loopjax.data.kg import hop_count
from loopjax.kg import ablations, beyond, grokking

# Composition's probe splits, in the order the figures and tables show them.
SPLITS = (
  "train_inferred",
  "test_inferred_id",
  "test_inferred_ood",
  "id_atomic",
  "ood_atomic",
)
FINAL = (
  "train_inferred/acc",
  "test_inferred_id/acc",
  "test_inferred_ood/acc",
  "test_inferred_ood/acc_given_atomic",
)


def splits(records: list[dict]) -> list[str]:
  """The splits to plot: composition's probes, or chains' atomic and test_k<k>."""
  keys = list(dict.fromkeys(k for r in report.evals(records) for k in report.accs(r)))
  composition = [s for s in SPLITS if s in keys]
  chains = sorted(
    (k for k in keys if k.startswith("test_") and hop_count(k)), key=hop_count
  )
  return composition or (["atomic"] if "atomic" in keys else []) + chains


def panels(names: list[str]) -> list[str]:
  """A sweep's overlay panels. Composition: train_inferred, test_inferred_id,
  ood. Chains: held-out chains of the four fewest hop counts (where a
  curriculum is at work)."""
  tests = [n for n in names if n not in SPLITS and n.startswith("test_")]
  return tests[:4] if tests else names[:3] or list(SPLITS[:3])  # no eval: empty


def final(records: list[dict], evals: list[dict]) -> tuple[list[dict], tuple]:
  """results.md's last columns: composition's accuracies (and OOD given the
  atomic facts), else each plotted split's."""
  if evals and "eval/train_inferred/acc" in evals[-1]:
    return evals, FINAL
  return evals, tuple(f"{s}/acc" for s in splits(evals)) if evals else ()


def phases(final_keys) -> tuple[str, ...]:
  """The phases results.md shows first: grokking's, for composition runs."""
  return tuple(grokking.PHASES) if any(k in FINAL for k in final_keys) else ()


def plots(workdir) -> list:
  """Accuracies against step and, for chains evaluated at several depths,
  those beyond the trained hops."""
  phases = report.reached_phases(workdir)
  return [report.plot_run(workdir), *beyond.write(workdir, phases)]


PARTS = report.Parts(
  claims=lambda records: bool(report.evals(records)),
  plots=plots,
  splits=splits,
  panels=panels,
  final=final,
  phases=phases,
  sweep=ablations.write,
)
