"""Report figures come from a run's records (no training needed here): the
trainer's chunks (`metrics/<ms>.jsonl`), or a legacy `metrics.jsonl`."""

import json

import pytest
from etils import epath

from loopjax import report, storage
from loopjax.kg import beyond
from loopjax.kg.report import SPLITS


def fake_run(workdir, ood_final):
  """A run's records as the trainer writes them: one chunk."""
  (workdir / "metrics").mkdir(parents=True)
  with (workdir / "metrics" / "0000000000001.jsonl").open("w") as f:
    f.write(json.dumps({"step": 0, "time": 0.0, "event": "start"}) + "\n")
    for step in (100, 1000, 10000):
      train = {"train/loss": 1.0, "train/acc": 0.5}
      f.write(json.dumps({"step": step, "time": step / 100} | train) + "\n")
      acc = {s: min(1.0, step / 1000) for s in SPLITS}
      acc["test_inferred_ood"] = ood_final * step / 10000
      f.write(
        json.dumps({"step": step} | {f"eval/{s}/acc": a for s, a in acc.items()}) + "\n"
      )
  (workdir / "phases.json").write_text(json.dumps({"memorize": 1000, "id": 1000}))


def test_run_curves_and_plot(tmp_path):
  fake_run(tmp_path / "r", 0.5)
  steps, acc = report.curves(tmp_path / "r")["test_inferred_ood"]
  assert steps == [100, 1000, 10000] and acc == [0.005, 0.05, 0.5]
  png, table = report.report(tmp_path / "r")
  assert png == tmp_path / "r/plots/accuracy.png" and png.read_bytes()[:4] == b"\x89PNG"
  row = table.read_text().splitlines()[2]
  # memorize and id at step 1000 = 10 s in; ood never; the last eval's accuracies
  assert row.startswith("| r | 10000 | 1.7 min | - | 1000 / 10 s | 1000 / 10 s |")
  assert row.endswith("| not reached | 1.000 | 1.000 | 0.500 | - |")


def test_sweep_root_gets_every_run_and_an_overlay(tmp_path):
  for r, ood in ((1, 0.0), (2, 0.9)):
    fake_run(tmp_path / f"num_loops={r}", ood)
  paths = report.report(tmp_path)
  assert paths[-2:] == [tmp_path / "plots/sweep.png", tmp_path / "results.md"]
  assert len(paths) == 4 and all(p.stat().length > 1000 for p in paths[:3])
  lines = paths[-1].read_text().splitlines()
  assert [x.split(" | ")[0] for x in lines[2:]] == ["| num_loops=1", "| num_loops=2"]


def test_a_sweep_on_a_bucket_is_reported_as_on_a_disk(bucket):
  """gs://: the runs found (a chunked one, a legacy one), the figures and
  results.md written there as objects, nothing on the local disk."""
  root = storage.path(bucket) / "sweep"
  fake_run(root / "a", 0.5)
  fake_chains_run(root / "b")
  (root / "a.log").write_text("a launcher's log beside the runs\n")
  paths = report.report(f"{bucket}/sweep")
  assert [str(p) for p in paths] == [
    f"{bucket}/sweep/{p}"
    for p in ("a/plots/accuracy.png", "b/plots/accuracy.png")
    + ("plots/sweep.png", "results.md")
  ]
  assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths[:3])
  lines = paths[-1].read_text().splitlines()
  assert [x.split(" | ")[:2] for x in lines[2:]] == [["| a", "10000"], ["| b", "1000"]]
  assert not epath.Path("gs:").exists()


def test_wall_times_add_up_resumed_segments():
  from loopjax.metrics import wall_times

  records = [
    {"step": 0, "time": 100.0, "event": "start"},
    {"step": 50, "time": 110.0},
    {"step": 100, "time": 120.0},  # killed after this; resumed from step 50
    {"step": 50, "time": 500.0, "event": "start"},
    {"step": 100, "time": 505.0},
  ]
  assert wall_times(records) == {50: 10.0, 100: 25.0}


def test_nothing_to_report(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"no loopjax run.s records \(metrics/\)"):
    report.report(tmp_path)


def fake_chains_run(workdir, evals=True):
  """A run from before chunks: its records in one legacy metrics.jsonl."""
  workdir.mkdir(parents=True)
  with (workdir / "metrics.jsonl").open("w") as f:
    f.write(json.dumps({"step": 0, "time": 0.0, "event": "start"}) + "\n")
    for step in (500, 1000):
      train = {"train/loss": 1.0, "train/acc": 0.5, "train/stage": 2}
      f.write(json.dumps({"step": step, "time": step / 100} | train) + "\n")
      if evals:
        acc = {"atomic": 1.0, "train_k2": 0.9} | {
          f"test_k{k}": step / 1000 / k for k in (2, 3, 4, 10)
        }
        f.write(
          json.dumps({"step": step} | {f"eval/{s}/acc": a for s, a in acc.items()})
          + "\n"
        )
  (workdir / "phases.json").write_text(json.dumps({"stage_3": 500} if evals else {}))


def test_chains_runs_plot_held_out_hops_and_curriculum_stages(tmp_path):
  fake_chains_run(tmp_path / "a")
  fake_chains_run(tmp_path / "b", evals=False)  # no eval yet
  assert list(report.curves(tmp_path / "a")) == [
    "atomic",
    "test_k2",
    "test_k3",
    "test_k4",
    "test_k10",
  ]
  assert report.curves(tmp_path / "b") == {}
  paths = report.report(tmp_path)
  lines = paths[-1].read_text().splitlines()
  assert lines[0].startswith("| run | steps | wall | steps/s | stage_3 | atomic/acc |")
  # final accuracies: atomic, test_k2, 3, 4, 10 at step 1000
  assert (
    lines[2]
    == "| a | 1000 | 10 s | - | 500 / 5 s | 1.000 | 0.500 | 0.333 | 0.250 | 0.100 |"
  )


def test_chains_beyond_training_by_depth_from_the_evaluation_job(tmp_path):
  """A run followed by `--mode=eval --follow` (training evaluated at R only):
  the chains K + 1..K + 4 hops deep get a curve per depth and a table, per
  step, of the curriculum stage and each k at the fixed depth, by the
  halting rule and at the best depth (the oracle), also as a JSON record."""
  from experiments import extrapolation
  from loopjax import config as config_lib

  c = extrapolation.get_config("tiny")  # K = 4, R = 4, chains to 5 hops
  c.data.max_hops, c.eval.depths = 8, (6, 8)
  run = tmp_path / "run"
  fake_chains_run(run)
  (run / "config.json").write_text(config_lib.to_json(c))
  (run / "phases.json").write_text(json.dumps({"stage_3": 500, "stage_4": 1500}))
  (run / "eval" / "metrics").mkdir(parents=True)  # the evaluation job's chunk
  with open(run / "eval" / "metrics" / "0000000000001.jsonl", "w") as f:
    for step, acc in (
      (1000, {4: 0.1, 6: 0.4, 8: 0.4}),
      (2000, {4: 0.2, 6: 0.3, 8: 0.7}),
    ):
      k5 = {"eval/test_k5/acc": acc[4]} | {
        f"eval/test_k5/acc@{d}": acc[d] for d in (6, 8)
      }
      if step == 2000:  # the halting rule: from here on
        k5 |= {"eval/test_k5/acc@halt": 0.65, "eval/test_k5/iters@halt": 5.5}
        k5 |= {"eval/halting/eps": 0.01, "eval/halting/tau": 0.3}
      f.write(json.dumps({"step": step, "eval/train_k4/acc": 1.0} | k5) + "\n")
  found = beyond.curves(beyond.depth_records(run), c)
  assert list(found) == [5]  # K = 4; k = 6..8: not evaluated here
  assert found[5] == {
    4: {1000: 0.1, 2000: 0.2},
    6: {1000: 0.4, 2000: 0.3},
    8: {1000: 0.4, 2000: 0.7},
  }
  paths = report.report(run)
  assert run / "plots/depths.png" in paths
  md = (run / "plots/depths.md").read_text().splitlines()
  assert "R = 4 iterations set before training" in md[0]  # 0: model.num_loops
  assert "KL < 0.01 and entropy < 0.3" in md[0]
  assert md[2] == "| step | stage | K + 1 fixed | K + 1 halt | K + 1 oracle |"
  # fixed R = 4; the oracle's best depth (a tie: the fewer iterations); stage
  # 3 from 500, 4 from 1500
  assert md[4:6] == [
    "| 1000 | 3 | 0.100 | - | 0.400 (R = 6) |",
    "| 2000 | 4 | 0.200 | 0.650 (5.5) | 0.700 (R = 8) |",
  ]
  assert "| K + 1 | halt | 2000 | 0 of 0 | 1 | 0.650 (step 2000) |" in md
  record = json.loads((run / "plots/depths.json").read_text())
  assert record["fixed_depth"] == 4 and record["train_hops"] == 4
  assert record["rows"][1]["k"]["5"] == {
    "fixed": 0.2,
    "halt": 0.65,
    "iters": 5.5,
    "oracle": 0.7,
    "oracle_R": 8,
  }


def test_runs_without_depths_get_no_depth_figure(tmp_path):
  fake_chains_run(tmp_path / "a")  # in-loop evaluations at R only
  assert beyond.depth_records(tmp_path / "a") == []
  assert tmp_path / "a/plots/depths.png" not in report.report(tmp_path / "a")


def test_held_says_when_the_claim_first_holds_and_whether_it_stays():
  """The per-k summary of plots/depths: first step >= 0.5, how many later
  evaluations stay there, the longest streak, the last value; per way."""

  def row(step, fixed, halt):
    return {"step": step, "k": {8: {"fixed": fixed, "halt": halt, "oracle": 0.9}}}

  table = [row(2, 0.1, None), row(4, 0.6, 0.2), row(6, 0.4, 0.3), row(8, 0.5, 0.3)]
  table += [row(10, 0.7, 0.4)]
  h = beyond.held(table)[8]
  assert h["fixed"] == {"first": 4, "after": [2, 3], "streak": 2, "last": (10, 0.7)}
  assert h["halt"] == {"first": None, "after": [0, 0], "streak": 0, "last": (10, 0.4)}
  assert h["oracle"]["first"] == 2 and h["oracle"]["streak"] == 5
  assert "| K + 2 | fixed | 4 | 2 of 3 | 2 | 0.700 (step 10) |" in beyond._held_table(
    6, beyond.held(table)
  )
