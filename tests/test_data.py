"""Data layer: generator invariants, the papers' JSON format, TFDS storage, CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_collections
import numpy as np
import pytest
from conftest import as_ltg_writes_it

import loopjax.data
import loopjax.kg.source
from loopjax import config as config_lib
from loopjax.data import grokked_json, kg, tfds_kg

# probe_size exceeds every pool, so the probes hold whole pools.
SMALL = dict(
  num_entities=30,
  num_relations=10,
  out_degree=5,
  ood_ratio=0.2,
  p_test_id=0.2,
  phi=3.0,
  probe_size=1000,
  seed=0,
)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data():
  return kg.composition(**SMALL)


def _rows(split):
  return {tuple(row) for row in split["inputs"].tolist()}


def _inferred(split):
  keep = split["bridge"] >= 0
  return {k: v[keep] for k, v in split.items()}


def _assert_same(a: kg.TaskData, b: kg.TaskData):
  assert a.vocab == b.vocab
  assert sorted(a.splits) == sorted(b.splits) == sorted(kg.SPLITS)
  for name in kg.SPLITS:
    for key in ("inputs", "target", "bridge"):
      x, y = a.splits[name][key], b.splits[name][key]
      assert x.dtype == y.dtype == np.int32, (name, key)
      np.testing.assert_array_equal(x, y, err_msg=f"{name}/{key}")
  assert kg.fingerprint(a) == kg.fingerprint(b)


def test_atomic_facts_are_all_in_train(data):
  E, D, pad = SMALL["num_entities"], SMALL["out_degree"], data.vocab.pad_id
  train = data.splits["train"]
  atomic = train["inputs"][:, 2] == pad
  heads, rels = train["inputs"][atomic, 0], train["inputs"][atomic, 1]
  assert atomic.sum() == E * D == len(set(zip(heads, rels, strict=True)))
  np.testing.assert_array_equal(np.bincount(heads, minlength=E), np.full(E, D))
  assert np.all((rels >= E) & (rels < pad)) and np.all(train["bridge"][atomic] == -1)
  probes = _rows(data.splits["id_atomic"]) | _rows(data.splits["ood_atomic"])
  assert probes == {tuple(r) for r in train["inputs"][atomic].tolist()}
  assert len(data.splits["ood_atomic"]["target"]) == round(SMALL["ood_ratio"] * E * D)


def test_inferred_answers_chain_atomic_facts(data):
  E, R = SMALL["num_entities"], SMALL["num_relations"]
  atomic = data.splits["train"]["bridge"] < 0
  h, r = data.splits["train"]["inputs"][atomic, :2].T
  tail_ER = np.full((E, R), -1)
  tail_ER[h, r - E] = data.splits["train"]["target"][atomic]
  for name in ("train", "train_inferred", "test_inferred_id", "test_inferred_ood"):
    split = _inferred(data.splits[name])
    assert len(split["target"]), name
    h, r1, r2 = split["inputs"].T
    np.testing.assert_array_equal(split["bridge"], tail_ER[h, r1 - E], err_msg=name)
    np.testing.assert_array_equal(
      split["target"], tail_ER[split["bridge"], r2 - E], err_msg=name
    )


def test_hops_are_ood_exactly_where_they_should_be(data):
  ood = {tuple(r[:2]) for r in data.splits["ood_atomic"]["inputs"].tolist()}

  def hops_ood(name):
    split = _inferred(data.splits[name])
    return [
      ((h, r1) in ood, (b, r2) in ood)
      for (h, r1, r2), b in zip(
        split["inputs"].tolist(), split["bridge"].tolist(), strict=True
      )
    ]

  assert set(hops_ood("test_inferred_ood")) == {(True, True)}
  for name in ("train", "train_inferred", "test_inferred_id"):
    assert set(hops_ood(name)) == {(False, False)}, name
  # The OOD pool is complete: every chain of two OOD facts is in it.
  ood_tail = {
    (h, r): t
    for (h, r, _), t in zip(
      data.splits["ood_atomic"]["inputs"].tolist(),
      data.splits["ood_atomic"]["target"].tolist(),
      strict=True,
    )
  }
  chains = {
    (h, r1, r2) for (h, r1), b in ood_tail.items() for (b2, r2) in ood_tail if b2 == b
  }
  assert _rows(data.splits["test_inferred_ood"]) == chains


def test_held_out_facts_are_not_trained_on(data):
  train = _rows(data.splits["train"])
  assert not train & _rows(data.splits["test_inferred_ood"])
  assert not train & _rows(data.splits["test_inferred_id"])
  assert _rows(data.splits["train_inferred"]) <= train
  assert len(train) == len(data.splits["train"]["target"])  # sampled w/o replacement


def test_sizes():
  data = kg.composition(**SMALL | {"probe_size": 7})
  E, D = SMALL["num_entities"], SMALL["out_degree"]
  num_id = E * D - round(SMALL["ood_ratio"] * E * D)
  assert len(data.splits["train"]["target"]) == E * D + round(SMALL["phi"] * num_id)
  for name in kg.PROBES:
    assert data.splits[name]["inputs"].shape == (7, 3), name
  assert (data.vocab.pad_id, data.vocab.vocab_size) == (40, 41)


def test_deterministic_by_seed(data):
  _assert_same(data, kg.composition(**SMALL))
  assert kg.fingerprint(kg.composition(**SMALL | {"seed": 1})) != kg.fingerprint(data)


def test_fingerprint_sees_every_value(data):
  splits = {name: dict(split) for name, split in data.splits.items()}
  splits["test_inferred_ood"]["bridge"] = splits["test_inferred_ood"]["bridge"].copy()
  splits["test_inferred_ood"]["bridge"][-1] += 1
  assert kg.fingerprint(kg.TaskData(data.vocab, splits)) != kg.fingerprint(data)


def test_phi_too_large_raises():
  with pytest.raises(ValueError, match=r"^data\.phi: .* use at most [\d.]+$"):
    kg.composition(**SMALL | {"phi": 4.0})


# --- the papers' JSON format ---


def test_json_round_trip(data, tmp_path):
  grokked_json.export(data, tmp_path)
  assert sorted(p.name for p in tmp_path.iterdir()) == [
    "test.json",
    "train.json",
    "valid.json",
    "vocab.json",
  ]
  lines = (tmp_path / "train.json").read_text().splitlines()
  assert len(lines) == len(data.splits["train"]["target"]) + 2  # one item a line
  valid = json.loads((tmp_path / "valid.json").read_text())
  assert len(valid) == len(data.splits["test_inferred_ood"]["target"])
  types = {x["type"] for x in json.loads((tmp_path / "test.json").read_text())}
  assert "test_inferred_iid" in types and "test_inferred_id" not in types
  _assert_same(grokked_json.load(tmp_path), data)


def test_json_load_reads_single_line_files(data, tmp_path):
  """The papers' scripts write each file with one json.dump call."""
  grokked_json.export(data, tmp_path)
  for path in tmp_path.iterdir():
    path.write_text(json.dumps(json.loads(path.read_text())))
  _assert_same(grokked_json.load(tmp_path), data)
  cfg = ml_collections.ConfigDict(
    {"source": f"grokked_json:{tmp_path}", "task": "composition", "pad_to": 0}
  )
  _assert_same(loopjax.kg.source.knowledge_graph(cfg), data)


def _corrupt(path: Path, line: int, old: str, new: str):
  lines = path.read_text().split("\n")
  assert old in lines[line - 1], lines[line - 1]
  lines[line - 1] = lines[line - 1].replace(old, new, 1)
  path.write_text("\n".join(lines))


@pytest.mark.parametrize(
  "file, line, old, new, message",
  [
    (
      "train.json",
      17,
      '{"input_text": "<e_',
      '{"input_text": "<e_99><e_',
      "unknown token '<e_99>'",
    ),
    ("test.json", 3, "</a>", "<e_0></a>", "target_text must be input_text followed"),
    ("train.json", 4, '"target_text":', '"target_text"', "invalid JSON"),
    ("test.json", 5, '"id_atomic"', '"atomic"', "unknown type 'atomic'"),
    ("test.json", 6, "<r_", "<r_1><r_", "does not match a 3-token input"),
  ],
)
def test_json_malformed_names_file_and_line(
  data, tmp_path, file, line, old, new, message
):
  grokked_json.export(data, tmp_path)
  _corrupt(tmp_path / file, line, old, new)
  # item i of an exported file is on line i + 2 (the list opens on line 1)
  with pytest.raises(
    ValueError, match=rf"^{file} item {line - 2} \(line {line}\): "
  ) as e:
    grokked_json.load(tmp_path)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_json_wrong_answer_is_caught(data, tmp_path):
  grokked_json.export(data, tmp_path)
  last = len((tmp_path / "test.json").read_text().splitlines()) - 1
  item = json.loads((tmp_path / "test.json").read_text().splitlines()[last - 1])
  answer = item["target_text"][len(item["input_text"]) : -len("</a>")]
  wrong = "<e_1>" if answer != "<e_1>" else "<e_2>"
  _corrupt(tmp_path / "test.json", last, f"{answer}</a>", f"{wrong}</a>")
  with pytest.raises(
    ValueError,
    match=rf"^test.json item {last - 2} \(line {last}\): the answer does not",
  ):
    grokked_json.load(tmp_path)


def test_json_missing_file(data, tmp_path):
  grokked_json.export(data, tmp_path)
  (tmp_path / "test.json").unlink()
  with pytest.raises(ValueError, match=r"test\.json: missing file"):
    grokked_json.load(tmp_path)


# --- TFDS storage ---


def _data_cfg(data_dir):
  c = config_lib.base().data
  c.update(SMALL, data_dir=str(data_dir))
  return c


def test_tfds_read_matches_generator_and_reuses_prepared_data(
  data, tmp_path, monkeypatch
):
  cfg = _data_cfg(tmp_path)
  _assert_same(tfds_kg.read(cfg), data)
  info = tfds_kg.prepare(cfg) / "dataset_info.json"
  assert info.is_file() and tmp_path in info.parents
  mtime = info.stat().st_mtime_ns

  def regenerate(**kwargs):
    raise AssertionError("prepared data was generated again")

  monkeypatch.setattr(kg, "composition", regenerate)
  _assert_same(loopjax.kg.source.knowledge_graph(cfg), data)
  assert info.stat().st_mtime_ns == mtime


def test_tfds_config_name_changes_with_every_param(tmp_path):
  names = set()
  params = kg.COMPOSITION.params
  for key in [None, *params]:
    cfg = _data_cfg(tmp_path)
    if key:
      cfg[key] += 0.01 if isinstance(cfg[key], float) else 1
    names.add(tfds_kg.config_name(cfg))
  assert len(names) == len(params) + 1
  assert tfds_kg.config_name(cfg) == "e30_r10_d5_ood0.2_pt0.2_phi3.0_n1000_s1"


def test_tfds_empty_splits_and_corruption(tmp_path):
  cfg = _data_cfg(tmp_path)
  cfg.ood_ratio = 0.0  # no OOD facts: ood_atomic and test_inferred_ood are empty
  data = tfds_kg.read(cfg)
  assert data.splits["test_inferred_ood"]["inputs"].shape == (0, 3)
  _assert_same(data, kg.composition(**SMALL | {"ood_ratio": 0.0}))
  metadata = tfds_kg.prepare(cfg) / "metadata.json"
  meta = json.loads(metadata.read_text())
  metadata.write_text(json.dumps(meta | {"fingerprint": "0" * 64}))
  with pytest.raises(ValueError, match="corrupt"):
    tfds_kg.read(cfg)


# --- CLI ---


def test_export_cli(tmp_path):
  out = tmp_path / "out"
  env = os.environ | {"PYTHONPATH": str(REPO)}
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "loopjax.data",
      "export",
      "--config=experiments/sysgen.py:tiny",
      f"--config.data.data_dir={tmp_path / 'data'}",
      f"--out={out}",
    ],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert str(out) in result.stdout
  assert sorted(p.name for p in out.iterdir()) == [
    "test.json",
    "train.json",
    "valid.json",
    "vocab.json",
  ]
  assert len(grokked_json.load(out).splits["train"]["target"]) > 0


def test_hops_are_the_atomic_facts_of_each_inferred_fact(data):
  train = data.splits["train"]
  atomic = train["bridge"] < 0
  facts = {
    tuple(r): t
    for r, t in zip(
      train["inputs"][atomic].tolist(), train["target"][atomic].tolist(), strict=True
    )
  }
  split = data.splits["test_inferred_ood"]
  for hop in kg.hops(split, data.vocab.pad_id):
    assert [facts[tuple(r)] for r in hop["inputs"].tolist()] == hop["target"].tolist()


def test_chains_answers_bridges_and_splits():
  from loopjax.data import kg

  args = dict(
    num_entities=30, num_relations=4, max_hops=5, train_per_hop=200, test_per_hop=40
  )
  data = kg.chains(**args, seed=0)
  again = kg.chains(**args, seed=0)
  assert kg.fingerprint(data) == kg.fingerprint(again)  # deterministic
  assert kg.fingerprint(data) != kg.fingerprint(kg.chains(**args, seed=1))
  E, pad = 30, data.vocab.pad_id
  atomic = data.splits["atomic"]
  assert len(atomic["target"]) == 30 * 4
  # Each relation is a bijection: the atomic facts define tail(r, h).
  tail = {}
  for (h, r, *_), t in zip(atomic["inputs"], atomic["target"], strict=True):
    tail[(r - E, h)] = t
  for r in range(4):
    assert sorted(tail[(r, h)] for h in range(E)) == list(range(E))
  for k in range(2, 6):
    tr, te = data.splits[f"train_k{k}"], data.splits[f"test_k{k}"]
    assert len(tr["target"]) == 200 and len(te["target"]) == 40
    rows = {tuple(x) for x in tr["inputs"]} | {tuple(x) for x in te["inputs"]}
    assert len(rows) == 240  # unique chains, train and test disjoint
    for split in (tr, te):
      for x, t, b in zip(
        split["inputs"], split["target"], split["bridges"], strict=True
      ):
        assert (x[k + 1 :] == pad).all() and (x[1 : k + 1] >= E).all()
        e, walk = x[0], []
        for r in x[1 : k + 1]:
          e = tail[(r - E, e)]
          walk.append(e)
        assert t == walk[-1] and list(b[: k - 1]) == walk[:-1]
        assert (b[k - 1 :] == -1).all()


def test_chains_too_many_asked():
  from loopjax.data import kg
  from loopjax.errors import ConfigError

  with pytest.raises(ConfigError, match="2-hop chains number 48"):
    kg.chains(
      num_entities=3,
      num_relations=4,
      max_hops=2,
      train_per_hop=40,
      test_per_hop=9,
      seed=0,
    )


CHAINS = dict(
  num_entities=20,
  num_relations=4,
  max_hops=5,
  train_per_hop=60,
  test_per_hop=10,
  seed=3,
)


@pytest.fixture(scope="module")
def chains():
  return kg.chains(**CHAINS)


def _assert_same_chains(a: kg.TaskData, b: kg.TaskData):
  assert a.vocab == b.vocab and a.task == b.task == "chains"
  assert list(a.splits) == list(b.splits)
  for name, split in a.splits.items():
    for key, x in split.items():
      np.testing.assert_array_equal(x, b.splits[name][key], err_msg=f"{name}/{key}")
  assert kg.fingerprint(a) == kg.fingerprint(b)


def test_chains_tfds_round_trip(chains, tmp_path):
  cfg = config_lib.base().data
  cfg.update(CHAINS, task="chains", data_dir=str(tmp_path))
  _assert_same_chains(loopjax.kg.source.knowledge_graph(cfg), chains)
  assert tfds_kg.config_name(cfg) == "e20_r4_k5_n60_t10_v0_s3"


def test_chains_ltg_json_round_trip(chains, tmp_path):
  """Bridges are not in the files: the reader recomputes them from the atomic
  facts, so equality checks the walk too."""
  grokked_json.export(chains, tmp_path)
  test = json.loads((tmp_path / "test.json").read_text())
  types = {x["type"] for x in test}
  assert types == {"atomic_facts"} | {
    f"{k}hop_{s}" for k in range(2, 6) for s in ("train", "test")
  }
  assert test == json.loads((tmp_path / "valid.json").read_text())
  small = json.loads((tmp_path / "test_small.json").read_text())
  assert len(small) == 4 * 10  # min(50, test_per_hop) per k
  first = json.loads((tmp_path / "train.json").read_text())[0]
  assert first["type"] == "atomic" and first["target_text"].endswith("</a>")
  cfg = ml_collections.ConfigDict(
    {"source": f"grokked_json:{tmp_path}", "task": "chains", "pad_to": 0}
  )
  _assert_same_chains(loopjax.kg.source.knowledge_graph(cfg), chains)


def test_chains_json_errors_name_the_item_and_line(chains, tmp_path):
  grokked_json.export(chains, tmp_path)
  path = tmp_path / "test.json"
  _corrupt(path, 2, '"2hop_test"', '"2hop_quiz"')
  with pytest.raises(
    config_lib.ConfigError, match=r"^test.json item 0 \(line 2\): unknown type"
  ):
    grokked_json.load(tmp_path, "chains")
  # One json.dump line, as the papers' scripts write it: the item's index.
  items = json.loads(path.read_text())
  path.write_text(json.dumps(items))
  with pytest.raises(config_lib.ConfigError, match=r"^test.json item 0: unknown type"):
    grokked_json.load(tmp_path, "chains")
  grokked_json.export(chains, tmp_path)
  lines = path.read_text().split("\n")
  item = json.loads(lines[1].rstrip(","))
  answer = int(item["target_text"].rsplit("<e_", 1)[1].split(">")[0])
  item["target_text"] = item["input_text"] + f"<e_{(answer + 1) % 20}></a>"
  lines[1] = json.dumps(item) + ","
  path.write_text("\n".join(lines))
  with pytest.raises(
    config_lib.ConfigError, match=r"item 0 \(line 2\): the answer does not follow"
  ):
    grokked_json.load(tmp_path, "chains")


def test_chains_in_ltgs_own_files_load_as_they_are(chains, tmp_path, capsys):
  """The official files: off-by-two train labels, one line, LTG's vocab.json
  (entities, relations, six special tokens) and test.json's three kinds."""
  grokked_json.export(chains, tmp_path)
  as_ltg_writes_it(tmp_path)
  assert (tmp_path / "train.json").read_text().count("\n") == 0
  assert json.loads((tmp_path / "vocab.json").read_text())[-6:] == list(
    grokked_json.SPECIALS
  )
  cfg = ml_collections.ConfigDict(
    {"source": f"grokked_json:{tmp_path}", "task": "chains", "pad_to": 0}
  )
  _assert_same_chains(
    loopjax.kg.source.knowledge_graph(cfg), chains
  )  # nothing dropped or moved
  err = capsys.readouterr().err.strip().splitlines()
  n_chains = sum(len(chains.splits[f"train_k{k}"]["target"]) for k in range(2, 6))
  assert len(err) == 1 and err[0].startswith(
    f"warning: train.json: {n_chains} of {n_chains + 80} items are labelled with "
    "another hop count than their chain has (4 labels, e.g. '0hop_train' on 2-hop"
  )


def test_a_mislabelled_test_chain_counts_as_its_chain(chains, tmp_path, capsys):
  grokked_json.export(chains, tmp_path)
  _corrupt(tmp_path / "test.json", 2, '"2hop_test"', '"3hop_test"')
  _assert_same_chains(grokked_json.load(tmp_path, "chains"), chains)
  assert "warning: test.json: 1 of" in capsys.readouterr().err


def test_train_split_is_a_curriculum_stage_and_probes_sample(chains):
  stage = kg.train_split(chains, 3)
  assert stage["inputs"].shape == (20 * 4 + 2 * 60, 4)  # atomic + k=2,3; 4 tokens
  assert (kg.train_split(chains, 5)["inputs"].shape[1]) == 6
  probes = kg.probes(chains, train_hops=3, size=25)
  assert list(probes) == [
    "atomic",
    "train_k2",
    "test_k2",
    "train_k3",
    "test_k3",
    "test_k4",
    "test_k5",
  ]
  assert len(probes["atomic"]["target"]) == len(probes["train_k2"]["target"]) == 25
  assert len(probes["test_k5"]["target"]) == 10  # test splits whole
  rows = {tuple(r) for r in chains.splits["train_k2"]["inputs"].tolist()}
  assert {tuple(r) for r in probes["train_k2"]["inputs"].tolist()} <= rows


def test_tfds_custom_config_warning_is_silenced(tmp_path, caplog):
  caplog.set_level("INFO")
  tfds_kg.read(_data_cfg(tmp_path))
  messages = [r.getMessage() for r in caplog.records]
  assert any("kg_composition" in m for m in messages)  # TFDS's other logs still pass
  assert not any("custom data configuration" in m for m in messages)
