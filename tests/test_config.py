"""Config validation: bad values fail before anything compiles, in one line."""

import re
import sys

import pytest
from conftest import in_process

from experiments import extrapolation, halting, sysgen
from loopjax import config as config_lib
from loopjax import workdir
from loopjax.errors import ConfigError

BAD = [
  ("model.num_loops", 0, "model.num_loops: must be in [1, 4096]"),
  ("model.num_loops", 10**9, "model.num_loops: must be in [1, 4096]"),
  ("data.ood_ratio", 1.5, "data.ood_ratio: must be in [0, 1]"),
  ("model.num_heads", 3, "model.num_heads: must divide model.d_model (64)"),
  ("model.injection", "sideways", "model.injection: must be one of none, add, concat"),
  (
    "model.norm_type",
    "batchnorm",
    "model.norm_type: must be one of layernorm, rmsnorm",
  ),
  ("model.remat", "some", "model.remat: must be one of none, full, dots"),
  ("data.out_degree", 41, "data.out_degree: must be <= data.num_relations (40)"),
  ("data.source", "csv:/x", "data.source: must be 'generate' or 'grokked_json:DIR'"),
  ("train.lr", -1.0, "train.lr: must be > 0"),
  ("train.b2", 1.0, "train.b2: must be in [0, 1)"),
  ("eval.depths", (2, 0), "eval.depths: a tuple of integers in [1, 4096]"),
  ("eval.depths", (2, 10**9), "eval.depths: a tuple of integers in [1, 4096]"),
  ("model.init_state", "zeros", "model.init_state: must be 'embedding' when"),
  ("train.backprop_depth", -1, "train.backprop_depth: must be >= 0"),
  ("train.backprop_depth", 2, "train.backprop_depth: needs model.injection add"),
  ("data.seed", -1, "data.seed: must be >= 0"),
  ("train.supervise", "all", "train.supervise: must be one of last, from_hops"),
  ("model.random_positions", -1, "model.random_positions: must be >= 0"),
  ("model.random_positions", 8, "model.random_positions: must be 0 unless model.pos"),
]


# On the k-hop chains config (experiments/extrapolation.py:cpu).
BAD_CHAINS = [
  ("data.max_hops", 1, "data.max_hops: must be >= 2"),
  ("data.train_hops", 13, "data.train_hops: must be in [2, data.max_hops=12]"),
  ("data.test_per_hop", 0, "data.test_per_hop: must be >= 1 with a curriculum"),
  ("train.curriculum.start", 7, "train.curriculum.start: must be in [2, data.train"),
  ("train.curriculum.threshold", 1.5, "train.curriculum.threshold: must be in [0, 1]"),
  ("train.curriculum.lr_decay", 0.0, "train.curriculum.lr_decay: must be in (0, 1]"),
  ("model.pos_encoding", "alibi", "model.pos_encoding: must be one of learned"),
  ("analyze.names", ("lens",), "analyze.names: each must be one of overthinking"),
  ("analyze.halting.criteria", ("kl", "x"), "analyze.halting.criteria: each must"),
  ("analyze.halting.r_min", 17, "analyze.halting.r_min: must be <= analyze.halting"),
  ("analyze.max_depth", 0, "analyze.max_depth: must be in [1, 4096]"),
  ("analyze.max_depth", 10**9, "analyze.max_depth: must be in [1, 4096]"),
  ("analyze.max_depth", 1, "analyze.max_depth: must be >= 2 for logit_lens"),
  ("analyze.tol", 0.0, "analyze.tol: must be > 0"),
  ("mesh.fsdp", -1, "mesh: data, fsdp and tensor must be >= 1, at most one -1"),
  ("mesh.tensor", 0, "mesh: data, fsdp and tensor must be >= 1"),
  ("sharding.rules", (("embed", "model"),), "sharding.rules: each must be"),
  ("model.num_heads", 64, "model.num_heads: rope needs an even head dimension"),
  ("model.random_positions", 12, "model.random_positions: must be 0 or >= the longest"),
]


def _set(c, field, value):
  *sections, key = field.split(".")
  for s in sections:
    c = c[s]
  c[key] = value


@pytest.mark.parametrize(
  "field,value,message", BAD_CHAINS, ids=[b[0] for b in BAD_CHAINS]
)
def test_bad_chains_value_names_field(field, value, message):
  c = extrapolation.get_config("cpu")
  _set(c, field, value)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c)
  assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_curriculum_needs_chains():
  c = sysgen.get_config("cpu")
  c.train.curriculum.enabled = True
  with pytest.raises(config_lib.ConfigError, match=r"^train.curriculum.enabled: needs"):
    config_lib.validate(c)


def test_sampled_depth_needs_a_valid_range():
  c = sysgen.get_config("cpu")
  c.train.depth.update(dist="poisson", min=5, max=3)
  with pytest.raises(config_lib.ConfigError, match=r"^train.depth.min: must be >= 1"):
    config_lib.validate(c)
  c.train.depth.update(min=2, max=8)
  config_lib.validate(c)


@pytest.mark.parametrize("variant", ["tiny", "cpu", "paper"])
@pytest.mark.parametrize("experiment", [sysgen, extrapolation, halting])
def test_variants_are_valid(experiment, variant):
  config_lib.validate(experiment.get_config(variant))


@pytest.mark.parametrize("field,value,message", BAD, ids=[b[0] for b in BAD])
def test_bad_value_names_field(field, value, message):
  c = sysgen.get_config("cpu")
  section, key = field.split(".")
  c[section][key] = value
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c)
  assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_conflicts_ignore_resumable_fields():
  old = sysgen.get_config("cpu").to_dict()
  new = sysgen.get_config("cpu")
  new.train.num_steps, new.eval_every, new.checkpoint.keep = 10**6, 7, 9
  assert workdir.conflicts(old, new.to_dict()) == []
  new.model.d_model = 128
  assert workdir.conflicts(old, new.to_dict()) == [
    "model.d_model=64 (workdir) vs 128 (new)"
  ]


def test_a_conflict_is_one_short_line_however_many_fields_differ(tmp_path):
  (tmp_path / "config.json").write_text(config_lib.to_json(sysgen.get_config("cpu")))
  new = extrapolation.get_config("paper")
  new.eval.depths = tuple(range(1, 200))  # a long value is cut
  with pytest.raises(config_lib.ConfigError) as e:
    workdir.Workdir(tmp_path).check(new)
  message = str(e.value)
  assert "\n" not in message and len(message) < 400, message
  assert re.search(r"; and \d+ more\. Use a new --workdir\.$", message), message


@pytest.mark.parametrize(
  "override,message",
  [
    ("--config.model.num_loops=0", "error: model.num_loops: must be in [1, 4096]"),
    ("--config.model.num_loops=abc", "error: "),
    (  # a long section: what is near the typo, and where all are listed
      "--config.model.no_such_field=1",
      "error: --config.model.no_such_field: no such field; none of config.model's",
    ),
    (
      "--config.model.num_loop=1",
      "error: --config.model.num_loop: no such field; did you mean num_loops or",
    ),
    (  # a short one: all of it
      "--config.eval.depth=1",
      "error: --config.eval.depth: no such field; config.eval has: batch_size, ",
    ),
    ("--config.seed.x=1", "error: --config.seed.x: config.seed is a value, not a"),
    ("--config.data.ood_ratio=1.5", "error: data.ood_ratio: must be in [0, 1]"),
    ("--config.eval.depths=abc", "error: eval.depths: a tuple of integers in"),
    (  # a name without a record in analysis/registry.py
      "--config.analyze.names=('no_such',)",
      "error: analyze.names: each must be one of overthinking, halting, logit_lens",
    ),
  ],
)
def test_cli_exits_2_with_one_line(tmp_path, override, message):
  r = in_process(
    [
      sys.executable,
      "-m",
      "loopjax.main",
      "--config=experiments/sysgen.py:tiny",
      f"--workdir={tmp_path / 'run'}",
      override,
    ]
  )
  assert r.returncode == 2, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(message), r.stderr
  assert not (tmp_path / "run").exists()  # nothing was created


@pytest.mark.parametrize(
  "config,message",
  [
    ("experiments/sysgen.py:huge", "error: .*variant"),
    (  # a typo in the most common flag
      "experiments/does_not_exist.py",
      r"error: --config=experiments/does_not_exist.py: cannot load the config "
      r"file \(no such file\)$",
    ),
    ("SYNTAX", r"error: .*broken.py:1: the config file does not parse \(invalid"),
    (
      "IMPORT",
      r"error: .*broken.py:2: the config file does not import \(No module named "
      r"'not_installed'\)$",
    ),
  ],
)
def test_cli_bad_config_file_or_variant(tmp_path, config, message):
  text = {  # an experiment file that does not parse, or does not import
    "SYNTAX": "def get_config(:\n  pass\n",
    "IMPORT": "import os\nimport not_installed\n",
  }
  if config in text:
    (tmp_path / "broken.py").write_text(text[config])
    config = str(tmp_path / "broken.py")
  cmd = [sys.executable, "-m", "loopjax.main", f"--config={config}"]
  r = in_process([*cmd, f"--workdir={tmp_path}"])
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1, r.stderr
  assert re.match(message, lines[0]), r.stderr


@pytest.mark.parametrize(
  "text, says",
  [
    ("[1, 2]", "config.json: the file must be a JSON object, not list"),
    ("null", "config.json: the file must be a JSON object, not NoneType"),
    ('{"model": 3}', "config.json: model must be a JSON object, not int"),
    ('{"train": {"depth": []}}', "config.json: train.depth must be a JSON object"),
    ('{"model": {"d_model": "abc"}}', "config.json: does not read as a loopjax config"),
  ],
)
def test_a_workdirs_config_json_of_the_wrong_shape_is_one_line(tmp_path, text, says):
  (tmp_path / "config.json").write_text(text)
  with pytest.raises(ConfigError, match=re.escape(says)):
    workdir.Workdir(tmp_path).saved_config()


def test_a_saved_config_reads_back_as_written(tmp_path):
  """JSON turns tuples into lists at every depth; a rule's mesh axes, a tuple
  inside a tuple, must come back as one (a list broke the mesh's lookup)."""
  c = sysgen.get_config()
  c.sharding.rules = (("batch", ("data", "fsdp")), ("embed", None))
  (tmp_path / "config.json").write_text(config_lib.to_json(c))
  back = workdir.Workdir(tmp_path).saved_config()
  assert back.sharding.rules == c.sharding.rules
  assert back.to_dict() == c.to_dict()


def test_a_dataset_json_without_a_fingerprint_is_one_line(tmp_path):
  for text in ("{}", "[]", '{"fingerprint": 3}'):
    (tmp_path / "dataset.json").write_text(text)
    says = "dataset.json: (has no fingerprint|the file)"
    with pytest.raises(ConfigError, match=says):
      workdir.Workdir(tmp_path).check_data({"fingerprint": "abc"})


def test_every_family_in_the_registry_resolves():
  """Each `task.FAMILIES` line names a Family of that name and a checker;
  the defaults fill what a family does not write."""
  from loopjax import task

  for name in task.FAMILIES:
    family = task.family(name)
    assert isinstance(family, task.Family) and family.name == name
    spec = task.spec(name)
    assert callable(spec.check) and set(spec.default_analyses) <= set(spec.analyses)
  assert task.family("chains").sampling_programs(None, None, None) == {}
  assert not task.family("composition").streams_analyses
  assert [n for n in task.FAMILIES if task.spec(n).curriculum] == ["chains"]
