"""Report figures come from metrics.jsonl (no training needed here)."""

import json

import pytest

from loopjax import report


def fake_run(workdir, ood_final):
  workdir.mkdir(parents=True)
  with open(workdir / "metrics.jsonl", "w") as f:
    for step in (100, 1000, 10000):
      f.write(json.dumps({"step": step, "train/loss": 1.0}) + "\n")
      acc = {s: min(1.0, step / 1000) for s in report.SPLITS}
      acc["test_inferred_ood"] = ood_final * step / 10000
      f.write(
        json.dumps({"step": step} | {f"eval/{s}/acc": a for s, a in acc.items()}) + "\n"
      )
  (workdir / "phases.json").write_text(json.dumps({"memorize": 1000, "id": 1000}))


def test_run_curves_and_plot(tmp_path):
  fake_run(tmp_path / "r", 0.5)
  steps, acc = report.curves(tmp_path / "r")["test_inferred_ood"]
  assert steps == [100, 1000, 10000] and acc == [0.005, 0.05, 0.5]
  [png] = report.report(tmp_path / "r")
  assert png == tmp_path / "r/plots/accuracy.png" and png.read_bytes()[:4] == b"\x89PNG"


def test_sweep_root_gets_every_run_and_an_overlay(tmp_path):
  for r, ood in ((1, 0.0), (2, 0.9)):
    fake_run(tmp_path / f"num_loops={r}", ood)
  paths = report.report(tmp_path)
  assert paths[-1] == tmp_path / "plots/sweep.png" and len(paths) == 3
  assert all(p.stat().st_size > 1000 for p in paths)


def test_nothing_to_report(tmp_path):
  with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
    report.report(tmp_path)
