"""A Hugging Face directory as `hf_dir.HfDir` reads it: the family of a
config.json alone (the `aot` path), a sharded index and the files it lists
checked in one line each, the memory-mapped files closed once read, and
RoPE's type under either version's name."""

import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from loopjax import config as config_lib
from loopjax import sharding
from loopjax.errors import ConfigError
from loopjax.pretrained import huginn, load, retrofit
from loopjax.pretrained.hf_dir import INDEX, HfDir

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def _huginn_with_rope_parameters(hf):
  hf["rope_parameters"] = {"rope_theta": hf["rope_base"], "rope_type": "default"}


# (fixture, its config file, an edit, the family config.json alone should be)
SHAPES = [
  ("huginn", "config.json", None, huginn),
  ("huginn", "config_v5.json", None, huginn),  # as transformers 5 saves it
  ("huginn", "config.json", _huginn_with_rope_parameters, huginn),
  ("retrofit_llama", "config.json", None, retrofit.LLAMA),
  ("retrofit_llama", "config_v5.json", None, retrofit.LLAMA),
  ("retrofit_olmo", "config.json", None, retrofit.OLMO2),
  ("retrofit_olmo", "config_v5.json", None, retrofit.OLMO2),
]


@pytest.mark.parametrize("name, file, edit, want", SHAPES)
def test_a_config_alone_is_the_model_its_weights_make(tmp_path, name, file, edit, want):
  """config.json without weights (an aot compile's shape) picks the family
  and model config that the directory with its weights does: Huginn's, as
  transformers 4.57 and 5 save it or with its base under rope_parameters, and
  each retrofitted model's (Llama's or OLMo 2's blocks, by the modeling module
  its auto_map names)."""
  hf = json.loads((FIXTURES / name / file).read_text())
  if edit:
    edit(hf)
  (tmp_path / "config.json").write_text(json.dumps(hf))
  base = config_lib.base()
  _, family, cfg, *_ = load.resolve(FIXTURES / name, base.model)
  assert family is want
  assert load.resolve(tmp_path, base.model, weights=False)[1] is want
  mesh = sharding.make_mesh(base.mesh, jax.devices()[:1])
  shape_cfg, _ = load.abstract(tmp_path, base.model, mesh, tuple(base.sharding.rules))
  assert shape_cfg.to_dict() == cfg.to_dict()


def test_a_retrofitted_config_that_does_not_name_its_blocks_is_refused(tmp_path):
  """Without tensors or an auto_map naming a converter's module (also as a
  copy from the hub writes it, "repo--module.Class"), Llama's and OLMo 2's
  blocks look alike: one line, not a guess; with its weights beside it (as
  sampling reads a directory) the tensors decide."""
  hf = json.loads((FIXTURES / "retrofit_olmo" / "config.json").read_text())
  del hf["auto_map"]
  (tmp_path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(ConfigError, match="does not say whether its blocks are Llama"):
    load.resolve(tmp_path, config_lib.base().model, weights=False)
  module = "raven_modeling_minimal_olmo.RavenForCausalLM"  # as a hub copy names it
  hf["auto_map"] = {"AutoModelForCausalLM": f"someone/retrofit-olmo--{module}"}
  (tmp_path / "config.json").write_text(json.dumps(hf))
  family = load.resolve(tmp_path, config_lib.base().model, weights=False)[1]
  assert family is retrofit.OLMO2
  del hf["auto_map"]
  (tmp_path / "config.json").write_text(json.dumps(hf))
  shutil.copy(FIXTURES / "retrofit_olmo" / "model.safetensors", tmp_path)
  family = load.resolve(tmp_path, config_lib.base().model, weights=False)[1]
  assert family is retrofit.OLMO2


def _sharded(path: Path) -> tuple[Path, dict]:
  """llama_gqa in two shards with their index; returns the dir and index."""
  tensors = load_file(FIXTURES / "llama_gqa" / "model.safetensors")
  names = sorted(tensors)
  shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in (0, 1)}
  path.mkdir(parents=True, exist_ok=True)
  for file, part in shards.items():
    save_file({n: tensors[n] for n in part}, path / file)
  index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
  (path / INDEX).write_text(json.dumps(index))
  shutil.copy(FIXTURES / "llama_gqa" / "config.json", path)
  return path, index


SHARD_1 = "model-00001-of-00002.safetensors"
EMBED = "model.embed_tokens.weight"


def _moved(index):  # the embedding listed in the shard it is not in
  shards = sorted(set(index["weight_map"].values()))
  index["weight_map"][EMBED] = shards[shards[0] == index["weight_map"][EMBED]]
  return json.dumps(index)


BAD_INDEX = [
  (lambda i: "{", f"{INDEX}: not JSON"),
  (lambda i: "[]", f"{INDEX}: has no weight_map"),
  (lambda i: '{"metadata": {}}', f"{INDEX}: has no weight_map"),
  (
    lambda i: '{"weight_map": ["a"]}',
    "weight_map must be a non-empty object of tensor name -> file; got list",
  ),
  (lambda i: '{"weight_map": {}}', "weight_map must be a non-empty object"),
  (
    lambda i: json.dumps({"weight_map": {EMBED: 3}}),
    f"weight_map.{EMBED} must name a file in the directory; got 3",
  ),
  (
    lambda i: json.dumps({"weight_map": {EMBED: "../config.json"}}),
    "must name a file in the directory; got '../config.json'",
  ),
  (_moved, f"tensor {EMBED} (File does not contain tensor {EMBED})"),
]


@pytest.mark.parametrize("index_text, message", BAD_INDEX)
def test_a_bad_index_is_one_line_naming_the_file(tmp_path, index_text, message):
  """Not JSON, no weight_map, one of another shape, a file name that is not
  one, a tensor placed in a shard that lacks it: a one-line ConfigError."""
  path, index = _sharded(tmp_path / "model")
  (path / INDEX).write_text(index_text(index))
  with pytest.raises(ConfigError, match=re.escape(message)) as e:
    load.load(path, config_lib.base().model)
  assert "\n" not in str(e.value)


def test_a_shard_that_is_not_safetensors_is_one_line(tmp_path):
  path, _ = _sharded(tmp_path / "model")
  (path / SHARD_1).write_bytes(b"not safetensors")
  with pytest.raises(ConfigError, match=f"{SHARD_1}: not a safetensors file"):
    load.load(path, config_lib.base().model)


def _mapped(file: Path) -> int:
  """How many of this process's memory mappings are of `file`."""
  maps = Path("/proc/self/maps")
  if not maps.exists():
    pytest.skip("needs /proc/self/maps")
  return sum(str(file.resolve()) in line for line in maps.read_text().splitlines())


def test_the_files_read_are_closed_after_and_the_arrays_stay(tmp_path):
  """A `with` block unmaps every file `take` opened (the directory object
  still alive); the arrays it returned are copies, still readable."""
  path, index = _sharded(tmp_path / "model")
  file = path / index["weight_map"][EMBED]
  with HfDir(path) as hf:
    x = hf.take(EMBED, (64, 32))
    assert _mapped(file) == 1
  assert _mapped(file) == 0
  np.testing.assert_array_equal(
    x, load_file(FIXTURES / "llama_gqa" / "model.safetensors")[EMBED]
  )
  hf.take(EMBED, (64, 32))  # opens it again
  assert _mapped(file) == 1
  hf.close()
  assert _mapped(file) == 0


def test_a_load_that_fails_leaves_no_file_mapped(tmp_path):
  """The error's traceback holds the loader's frame: no file stays mapped
  while it lives."""
  path, index = _sharded(tmp_path / "model")
  save_file({"extra": np.zeros(2, np.float32)}, path / "extra.safetensors")
  index["weight_map"]["extra"] = "extra.safetensors"
  (path / INDEX).write_text(json.dumps(index))
  with pytest.raises(ConfigError, match="unexpected tensor extra") as e:
    load.load(path, config_lib.base().model)
  assert e.value.__traceback__ is not None
  assert [_mapped(f) for f in sorted(path.glob("*.safetensors"))] == [0, 0, 0]


LLAMA3 = {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip
ROPE_TYPES = [  # (rope_scaling, rope_parameters, the llama3 rescaling or the error)
  (LLAMA3 | {"type": "llama3"}, None, (4.0, 1.0, 4.0, 16)),
  (None, LLAMA3 | {"rope_type": "llama3", "rope_theta": 5e5}, (4.0, 1.0, 4.0, 16)),
  (LLAMA3 | {"type": "llama3", "rope_type": "llama3"}, None, (4.0, 1.0, 4.0, 16)),
  (
    LLAMA3 | {"type": "llama3", "rope_type": "default"},
    None,
    "rope_type ('default') and type ('llama3') disagree",
  ),
  (
    LLAMA3 | {"type": "llama3"},
    {"rope_type": "default", "rope_theta": 5e5},
    "rope_type ('default') and type ('llama3') disagree",
  ),
]


@pytest.mark.parametrize("scaling, params, want", ROPE_TYPES)
def test_rope_type_is_read_under_either_name_and_two_that_disagree_fail(
  tmp_path, scaling, params, want
):
  """transformers 5 names it rope_type, 4.x type (in rope_scaling): either
  one alone is read; both, with two values, is one line, not a pick."""
  path = tmp_path / "model"
  shutil.copytree(FIXTURES / "llama_gqa", path)
  hf = json.loads((path / "config.json").read_text())
  hf.update(rope_scaling=scaling, rope_parameters=params)
  (path / "config.json").write_text(json.dumps(hf))
  base = config_lib.base().model
  if isinstance(want, str):
    with pytest.raises(ConfigError, match=re.escape(want)):
      load.resolve(path, base, weights=False)
  else:
    cfg = load.resolve(path, base, weights=False)[2]
    assert tuple(cfg.rope_llama3) == want
