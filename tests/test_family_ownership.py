"""Each task family owns what differs about it (issue 53): the shared report and
data code import and branch on no family, the batch layout has one source,
every analysis callback has one signature, LTG's recipe is written once, the
harness adapter hands results back by return value. Read from the code's
syntax trees (imports, comparisons, attribute reads), not grepped text."""

import ast
import inspect
import sys
from pathlib import Path

import pytest

from loopjax import task

PKG = Path(__file__).resolve().parents[1] / "loopjax"
FAMILY_PACKAGES = ("loopjax.kg", "loopjax.lm")
# Each family's own data modules, which its package imports (registers).
FAMILY_DATA = {
  "loopjax.data.kg": "loopjax.kg",
  "loopjax.data.kg_generate": "loopjax.kg",
  "loopjax.data.tfds_kg": "loopjax.kg",
  "loopjax.data.grokked_json": "loopjax.kg",
  "loopjax.data.lm": "loopjax.lm",
}
NAMES = {*task.FAMILIES, "kg", "lm"}


def _module(path: Path) -> str:
  rel = path.relative_to(PKG.parent).with_suffix("")
  parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
  return ".".join(parts)


def _imports(path: Path) -> set[str]:
  """Every module `path` imports, absolute (`from x import y` counts x.y,
  which is x's submodule y when there is one)."""
  tree, here = ast.parse(path.read_text()), _module(path)
  package = here if path.name == "__init__.py" else here.rpartition(".")[0]
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*up, base] if base else up)
      out |= {base} | {f"{base}.{a.name}" for a in node.names}
  return out


def _shared() -> list[Path]:
  """report.py and the data package's modules no family owns."""
  data = [
    p for p in sorted((PKG / "data").glob("*.py")) if _module(p) not in FAMILY_DATA
  ]
  return [PKG / "report.py", *data]


def _is_family(module: str) -> bool:
  return module.startswith(FAMILY_PACKAGES) or module in FAMILY_DATA


def test_report_and_shared_data_import_no_family():
  for path in _shared():
    found = sorted(m for m in _imports(path) if _is_family(m))
    assert not found, f"{path.relative_to(PKG.parent)} imports {found}"


def test_report_and_shared_data_branch_on_no_family_name():
  """No family name in a comparison, a subscript, a dict key or a match case."""
  for path in _shared():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Compare):
        values = [node.left, *node.comparators]
      elif isinstance(node, ast.Subscript):
        values = [node.slice]
      elif isinstance(node, ast.Dict):
        values = node.keys
      elif isinstance(node, ast.MatchValue):
        values = [node.value]
      else:
        continue
      named = [
        v.value for v in values if isinstance(v, ast.Constant) and v.value in NAMES
      ]
      assert not named, f"{path.relative_to(PKG.parent)}:{node.lineno}: {named}"


def test_each_family_data_module_is_imported_by_its_family():
  importers = {
    m: {_module(p) for p in PKG.rglob("*.py") if m in _imports(p)} for m in FAMILY_DATA
  }
  for module, family in FAMILY_DATA.items():
    theirs = {m for m, f in FAMILY_DATA.items() if f == family}
    assert any(i.startswith(family) or i in theirs for i in importers[module]), module


def test_the_batch_layout_has_one_source():
  """`data.pad_to` is read from the config once, where the task is loaded
  (kg/source.py); everything after reads the task's `pad_to`."""
  readers = []
  for path in PKG.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if (
        isinstance(node, ast.Attribute)
        and node.attr == "pad_to"
        and isinstance(node.ctx, ast.Load)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "data"
      ):
        readers.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
  assert not readers, f"config.data.pad_to read outside kg/source.py: {readers}"


@pytest.mark.parametrize("name", list(task.FAMILIES))
def test_every_analysis_callback_has_one_signature(name):
  """compute(model, inputs) and summarize(examples, inputs), `inputs` a
  record.Inputs, in every family."""
  from loopjax.analysis import registry

  table = task.spec(name).analyses
  for analysis in table:
    record = registry.record(table, analysis)
    for fn in (record.compute, record.summarize):
      if fn is not None:
        params = list(inspect.signature(fn).parameters)
        assert len(params) == 2, (name, analysis, fn, params)


@pytest.mark.parametrize("name", list(task.FAMILIES))
def test_every_family_names_its_report(name):
  from loopjax import report
  from loopjax.names import imported

  assert isinstance(imported(task.spec(name).report), report.Parts)


def test_both_paper_variants_take_ltgs_recipe_from_one_place(monkeypatch):
  from experiments import extrapolation, sysgen
  from loopjax.kg import ltg

  calls = []
  real = ltg.recipe
  monkeypatch.setattr(ltg, "recipe", lambda c, **kw: calls.append(kw) or real(c, **kw))
  sysgen.get_config("paper")
  extrapolation.get_config("paper")
  assert calls == [
    {"weight_decay": 0.1, "label_smoothing": 0.1},
    {"weight_decay": 0.01, "label_smoothing": 0.0},
  ]


def test_the_harness_adapter_keeps_no_results_on_the_instance():
  """Only the constructors set attributes on the model; no method reads its
  own call's arguments back through `locals()`."""
  tree = ast.parse((PKG / "lm" / "harness.py").read_text())
  (cls,) = [
    n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LoopjaxLM"
  ]
  for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
    if fn.name in ("__init__", "_use", "of"):
      continue
    for node in ast.walk(fn):
      targets = node.targets if isinstance(node, ast.Assign) else []
      for t in targets:
        assert not (
          isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
          and t.value.id == "self"
        ), f"LoopjaxLM.{fn.name} sets self.{t.attr}"  # fmt: skip
  calls = [
    n
    for n in ast.walk(tree)
    if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "locals"
  ]
  assert not calls


def test_an_unreachable_hub_turns_the_libraries_offline_at_once(monkeypatch):
  """No route to the hub: one connection attempt, then the hub and datasets
  libraries read from disk only (a missing data set then fails at once)."""
  pytest.importorskip("lm_eval")
  import socket
  import time

  import datasets.config
  from huggingface_hub import constants

  from loopjax.lm import harness_hub

  for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    monkeypatch.delenv(name, raising=False)
  for name in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
    monkeypatch.delenv(name, raising=False)  # the loopback hub, directly
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
  monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
  with socket.socket() as s:  # a port nothing listens on: refused at once
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
  t0 = time.monotonic()
  assert harness_hub.offline_unless_reachable()
  assert time.monotonic() - t0 < harness_hub.REACH_TIMEOUT_S
  assert constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
  assert datasets.config.HF_DATASETS_OFFLINE
  import os

  assert os.environ["HF_DATASETS_OFFLINE"] == "1"


def test_a_reachable_hub_changes_nothing(monkeypatch):
  pytest.importorskip("lm_eval")
  import socket

  from huggingface_hub import constants

  from loopjax.lm import harness_hub

  for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    monkeypatch.delenv(name, raising=False)
  for name in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
    monkeypatch.delenv(name, raising=False)  # the loopback hub, directly
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    monkeypatch.setattr(
      constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}"
    )
    assert not harness_hub.offline_unless_reachable()
  import os

  assert "HF_HUB_OFFLINE" not in os.environ


def test_no_module_passes_the_house_limit():
  """~400 lines (STYLE.md): a longer module probably owns two jobs."""
  long = {
    str(p.relative_to(PKG.parent)): n
    for p in PKG.rglob("*.py")
    if (n := len(p.read_text().splitlines())) > 400
  }
  assert not long, long


if __name__ == "__main__":
  sys.exit(pytest.main([__file__]))


def test_behind_a_proxy_the_hub_is_reached_through_it(monkeypatch):
  """A cluster whose only way out is its proxy: the reachability check
  connects to the proxy, not to the hub it cannot reach directly."""
  pytest.importorskip("lm_eval")
  from huggingface_hub import constants

  from loopjax.lm import harness_hub

  monkeypatch.setattr(constants, "ENDPOINT", "https://huggingface.co")
  for name in ("https_proxy", "HTTPS_PROXY", "no_proxy", "NO_PROXY"):
    monkeypatch.delenv(name, raising=False)
  assert harness_hub._endpoint() == ("huggingface.co", 443)
  monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
  assert harness_hub._endpoint() == ("proxy.example", 3128)
  monkeypatch.setenv("NO_PROXY", "huggingface.co")
  assert harness_hub._endpoint() == ("huggingface.co", 443)
