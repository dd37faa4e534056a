"""The results pages say what their committed records hold (issue 54).

Each figure a page or the README quotes is recomputed here from the record
it came from: `--mode=report`'s tables (`grokking_speed_runs.md`, the
`records/*_depths.json` of an extrapolation run) or, for runs lost with
their checkpoints, the one transcribed list their summaries are checked
against (`records/long_k2_2026-12-06.json`). A page edited to say more than
its record fails here.
"""

import json
import pathlib
import re
import statistics

import pytest

ROOT = pathlib.Path(__file__).parents[1]
RESULTS = ROOT / "docs" / "results"
RECORDS = RESULTS / "records"


def _tables(text: str) -> list[list[list[str]]]:
  """Every markdown table in `text`, header row first, cells stripped."""
  out, rows = [], []
  for line in [*text.splitlines(), ""]:
    if line.startswith("|"):
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      if set("".join(cells)) - set("-: "):  # not the |---| rule
        rows.append(cells)
    elif rows:
      out.append(rows)
      rows = []
  return out


def _numbers(cell: str) -> list[float]:
  """The decimal numbers in a cell, thousands separators dropped."""
  return [float(n) for n in re.findall(r"\d[\d,]*\.?\d*", cell.replace(",", ""))]


def _step(cell: str) -> int:
  return int(cell.replace(",", ""))


def _section(text: str, heading: str) -> str:
  """The text under a `## heading` up to the next `## `."""
  start = text.index(f"## {heading}")
  end = text.find("\n## ", start + 1)
  return text[start : None if end < 0 else end]


# -- grokking speed: the page's tables against --mode=report's runs tables


def _runs_record() -> dict[tuple[str, str], str]:
  """{(sweep, run): "step / wall" or "not reached"} of the OOD phase."""
  text = (RESULTS / "grokking_speed_runs.md").read_text()
  out = {}
  for sweep in ("accelerators", "more_accelerators"):
    (table,) = _tables(_section(text, f"`{sweep}` (2026"))
    ood = table[0].index("ood")
    out |= {(sweep, row[0]): row[ood] for row in table[1:]}
  return out


# the page's recipe names -> (sweep, the run's name without its seed)
GROKKING_RECIPES = {
  "none": ("accelerators", ""),
  "none (above)": ("accelerators", ""),
  "Grokfast EMA": ("accelerators", "kind=ema,"),
  "StableMax": ("accelerators", "xent=stablemax,"),
  "Grokfast MA": ("accelerators", "kind=ma,lamb=5.0,"),
  "perp-Grad": ("accelerators", "perp_grad=True,"),
  "Grokfast EMA + StableMax": ("more_accelerators", "kind=ema,xent=stablemax,"),
  "Grokfast EMA, lamb 0.5": ("more_accelerators", "kind=ema,lamb=0.5,"),
  "perp-Grad, weight decay 0": (
    "more_accelerators",
    "perp_grad=True,weight_decay=0.0,",
  ),
}


def _grokking_tables() -> list[list[list[str]]]:
  text = (RESULTS / "grokking_speed.md").read_text()
  tables = [
    t for t in _tables(text) if t[0][:4] == ["recipe", "seed 0", "seed 1", "seed 2"]
  ]
  assert len(tables) == 2
  return tables


def test_grokking_speed_steps_are_the_report_rows():
  """Every seed's steps to OOD >= 0.9 (and its wall time) is its run's row;
  a seed with no run is "-"; medians and "vs none" are computed from them."""
  record = _runs_record()
  base = statistics.median(
    int(record["accelerators", f"seed={s}"].split(" / ")[0]) for s in range(3)
  )
  for table in _grokking_tables():
    for recipe, *seeds, median, versus in table[1:]:
      sweep, run = GROKKING_RECIPES[recipe]
      steps = []
      for seed, cell in enumerate(seeds):
        row = record.get((sweep, f"{run}seed={seed}"))
        if cell == "-":
          assert row is None, (recipe, seed)
        elif row == "not reached":
          assert cell.startswith("not reached"), (recipe, seed, cell)
        else:
          assert cell == row.replace(
            row.split(" / ")[0], f"{int(row.split(' / ')[0]):,}"
          )
          steps.append(int(row.split(" / ")[0]))
      if len(steps) == 3:
        assert median == f"{statistics.median(steps):,.0f}", recipe
        assert versus.startswith(f"{base / statistics.median(steps):.2f}x"), recipe
      else:
        assert median == "-", recipe


def test_grokking_speed_per_seed_claims_are_the_records():
  """ "Later in every seed" holds seed by seed, with the range the page gives."""
  record = _runs_record()
  text = (RESULTS / "grokking_speed.md").read_text()

  def ratios(run):
    return [
      int(record["accelerators", f"{run}seed={s}"].split(" / ")[0])
      / int(record["accelerators", f"seed={s}"].split(" / ")[0])
      for s in range(3)
    ]

  ema = ratios("kind=ema,")
  assert min(ema) > 1
  assert f"in every seed ({min(ema):.2f}-{max(ema):.2f}x its steps)" in text
  stablemax = ratios("xent=stablemax,")
  assert stablemax[0] > 1 and stablemax[1] > 1 and stablemax[2] == 1
  assert f"later in seeds 0 and 1\n  ({stablemax[1]:.2f}x)" in text
  assert "MA and perp-Grad: seed 0 only" in text
  assert not any(
    ("accelerators", f"kind=ma,lamb=5.0,seed={s}") in record for s in (1, 2)
  )


# -- extrapolation: the lost runs' K + 2 / K + 4 against their one list


def _k2_record() -> dict:
  return json.loads((RECORDS / "long_k2_2026-12-06.json").read_text())["runs"]


def _at_least_half(values) -> tuple[int, int]:
  return sum(v >= 0.5 for v in values), len(values)


def test_extrapolation_best_depth_table_is_the_k2_record():
  """The page's best-depth table (seed 0 and its fork) row by row."""
  runs = _k2_record()
  text = (RESULTS / "extrapolation.md").read_text()
  (table,) = [t for t in _tables(text) if t[0][1].startswith("lr 2e-3 (`long`)")]
  seen = 0
  for row in table[1:]:
    step = str(_step(row[0]))
    for run, (k2, k4) in (("d128_rp64", (2, 4)), ("d128_rp64_lr5e-4", (6, 8))):
      values = _numbers(row[k2])
      if step in runs[run]["k2"] and values:
        assert values[0] == runs[run]["k2"][step], (run, step)
        assert _numbers(row[k4])[0] == runs[run]["k4"][step], (run, step)
        seen += 1
  assert seen == 12  # 5 of seed 0's evaluations, 7 of the fork's


def test_extrapolation_summaries_count_what_the_k2_record_holds():
  """ "K + 2 >= 0.5 at n of m evaluations", its range, and K + 4's one pass,
  wherever they are quoted (the page, the README, the search page)."""
  runs = _k2_record()
  page = (RESULTS / "extrapolation.md").read_text()
  readme = (ROOT / "README.md").read_text()
  search = (ROOT / "docs" / "extrapolation_search.md").read_text()
  k2 = {run: list(r["k2"].values()) for run, r in runs.items()}
  every = [v for values in k2.values() for v in values]
  n, m = _at_least_half(every)
  assert f">= 0.5 at {n} of {m} evals of three correlated runs" in readme
  assert f"K + 2 at {min(every):.2f}-{max(every):.3f}" in readme
  n, m = _at_least_half(k2["d128_rp64"])
  assert f">= 0.5 at {n} of {m} evals from 18k" in search
  assert f">= 0.5 at {n} of {m} evaluations;" in page
  n, m = _at_least_half(k2["d128_rp64_lr5e-4"])
  assert f">= 0.5 at {n} of {m} evals)" in search
  assert f"K + 2 >= 0.5 at {n} of {m}\n  evaluations from 20k on" in page
  n, m = _at_least_half(k2["d128_rp64_s1_decay"])
  assert f">= 0.5 at {n} of {m} evals from 18k" in search
  for run, values in k2.items():  # the best K + 2 in the search table
    assert re.search(rf"\| {re.escape(run)} \|.*\*\*{max(values)}\*\*", search), run
  k4 = [v for r in runs.values() for v in r["k4"].values() if v is not None]
  passes = [v for v in k4 if v >= 0.5]
  assert passes == [0.595]
  assert "K + 4 0.595 once" in readme
  assert max(v for v in k4 if v < 0.5) == 0.355
  assert "at most 0.355 in the table above" in page
  assert "K + 4 stays below 0.5" not in page


# -- extrapolation from here on: --mode=report's depth records


def _lead_rows(text: str, record: str) -> list[list[str]]:
  """The rows of the fixed / halt / oracle table in the section that links
  `record`."""
  start = text.index(f"(records/{record}.md)")
  section = text[text.rindex("\n## ", 0, start) : text.index("\n## ", start)]
  (table,) = [t for t in _tables(section) if "fixed / halt (iters) / oracle" in t[0][2]]
  return table[1:]


@pytest.mark.parametrize(
  "record", sorted(p.stem for p in RECORDS.glob("long_s*_depths.json"))
)
def test_extrapolation_lead_table_is_the_depth_record(record):
  """Each row of the page's fixed / halt / oracle table is the report's
  record at that step: K + 1 and K + 2 three ways, K + 3 and K + 4 oracle."""
  data = json.loads((RECORDS / f"{record}.json").read_text())
  rows = {r["step"]: r for r in data["rows"]}
  table = _lead_rows((RESULTS / "extrapolation.md").read_text(), record)
  assert table
  for row in table:
    r = rows[_step(row[0])]
    assert int(row[1]) == r["stage"]
    for cell, k in ((row[2], "7"), (row[3], "8")):
      got = _numbers(cell.replace("R = ", ""))
      want = r["k"][k]
      assert got[:4] == [
        round(want["fixed"], 3),
        round(want["halt"], 3),
        round(want["iters"], 1),
        round(want["oracle"], 3),
      ], (record, r["step"], k)
    assert _numbers(row[4])[0] == round(r["k"]["9"]["oracle"], 3)
    assert _numbers(row[5])[0] == round(r["k"]["10"]["oracle"], 3)


def test_extrapolation_ema_table_is_its_record():
  """The EMA lever's table (raw params beside their EMA, fixed R and
  halting) row by row against the fork's record."""
  data = json.loads((RECORDS / "long_s2_ema24k.json").read_text())
  rows = {r["step"]: r for r in data["rows"]}
  text = (RESULTS / "extrapolation.md").read_text()
  (table,) = [t for t in _tables(text) if t[0][1] == "K + 2 raw: fixed / halt"]
  assert len(table) - 1 == len(rows)
  for row in table[1:]:
    r = rows[_step(row[0])]
    for i, k in enumerate(("8", "9", "10")):
      for j, who in enumerate(("raw", "ema")):
        want = [round(r[who][k]["fixed"], 3), round(r[who][k]["halt"], 3)]
        assert _numbers(row[1 + 2 * i + j]) == want, (r["step"], k, who)
