"""Config fuzzing: random overrides give a one-line ConfigError or a run that starts.

Values are drawn per field type, as the command line would parse them (a value
of the wrong type is the flag parser's one-line error, tested in test_config).
A config that validates must get through data generation, model construction,
tracing of the train step and a real evaluation without any other exception.
"""

import json
import math
import os
import subprocess
import sys
import time

import jax
import pytest
from conftest import CPU_ENV, main_in_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments import sysgen
from loopjax import config as config_lib
from loopjax import field_rules
from loopjax.data import kg, pipeline, tfds_kg
from loopjax.kg.evaluate import Evaluator
from loopjax.state import train_state
from loopjax.train import make_train_step

SKIP = {"data.data_dir", "variant"}  # where files go, not what runs


def _fields(c, prefix=""):
  for k, v in c.items():
    if hasattr(v, "items"):
      yield from _fields(v, f"{prefix}{k}.")
    elif f"{prefix}{k}" not in SKIP:
      yield f"{prefix}{k}", v


FIELDS = dict(_fields(sysgen.get_config("tiny")))


def _values(field):
  default = FIELDS[field]
  if isinstance(default, bool):
    return st.booleans()
  if isinstance(default, int):  # small: a valid run must fit in a test
    return st.integers(-2, 40)
  if isinstance(default, float):
    return st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
      [0.0, 0.5, 1.0, 1e-9]
    )
  if isinstance(default, str):
    allowed = field_rules.ENUMS.get(field, ())
    return st.sampled_from((*allowed, "", "grokked_json:/nonexistent")) | st.text(
      max_size=8
    )
  return st.lists(st.integers(-2, 8), max_size=3).map(tuple)  # eval.depths


overrides = st.lists(
  st.sampled_from(sorted(FIELDS)).flatmap(lambda f: st.tuples(st.just(f), _values(f))),
  min_size=1,
  max_size=3,
)


def _dry_run(c):
  """What a run does before its first step, with abstract arrays for the step."""
  if c.data.source != "generate":  # the JSON reader's errors: test_data
    raise config_lib.ConfigError("not generated")
  task = tfds_kg.generate(c.data)
  graphdef, state, tx = train_state(c, task)
  batch = next(
    pipeline.train_iterator(
      kg.train_split(task, c.data.train_hops),
      c.train.batch_size,
      c.seed,
      task.vocab.pad_id,
      c.data.atomic_repeat,
    )
  )
  step = make_train_step(c, graphdef, tx)
  _, out = jax.eval_shape(step, state, batch)
  assert out["train/loss"].shape == ()
  Evaluator(graphdef, c, task).run(state["params"])  # compiled and run for real


def _settings(n):
  return settings(
    max_examples=n,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,  # the same examples on every machine: CI stays reproducible
  )


def _apply_and_check(pairs):
  c = sysgen.get_config("tiny")
  for field, value in pairs:
    section, key = field.rsplit(".", 1) if "." in field else ("", field)
    (c[section] if section else c)[key] = value
  try:
    config_lib.validate(c)
    _dry_run(c)
  except config_lib.ConfigError as e:
    msg = str(e)
    assert msg and "\n" not in msg and len(msg) < 400, msg


@_settings(6)  # 300: -m slow
@given(overrides)
def test_random_overrides_fail_cleanly_or_run(pairs):
  _apply_and_check(pairs)


@pytest.mark.slow
@_settings(300)
@given(overrides)
def test_random_overrides_many(pairs):
  _apply_and_check(pairs)


def test_huge_phi_is_a_config_error():
  c = sysgen.get_config("tiny")
  c.data.phi = 1e308  # phi * facts overflows to inf
  config_lib.validate(c)
  with pytest.raises(config_lib.ConfigError, match="data.phi"):
    tfds_kg.generate(c.data)
  assert math.isinf(c.data.phi * 1000)


# lm-evaluation-harness's `--model_args` for `--model loopjax`: a value of any
# type the harness's parser makes (int, float, bool, None, str) under any of
# the model's argument names or another name.
_harness_value = (
  st.integers(-3, 40)
  | st.floats(allow_nan=True, allow_infinity=True)
  | st.booleans()
  | st.none()
  | st.text(alphabet="abcxyz0123456789.-", max_size=6)
)


@settings(max_examples=60, deadline=None)
@given(
  st.dictionaries(
    st.sampled_from(
      [
        "num_loops",
        "batch_size",
        "max_length",
        "max_gen_toks",
        "r_min",
        "step",
        "seed",
        "dtype",
        "add_bos_token",
        "threshold",
        "num_loop",
        "device",
      ]
    ),  # fmt: skip
    _harness_value,
    max_size=4,
  )
)
def test_harness_model_args_are_one_line_or_accepted(args):
  """`--model loopjax` arguments, checked before the harness starts: a
  ConfigError (one line) or accepted, never another exception."""
  pytest.importorskip("lm_eval")
  from lm_eval import utils

  from loopjax.errors import ConfigError
  from loopjax.lm import harness_args

  text = ",".join(f"{k}={v}" for k, v in args.items())
  try:
    harness_args.precheck(["--model", "loopjax", "--model_args", text])
  except ConfigError as e:
    assert len(str(e).splitlines()) == 1
    return
  parsed = utils.simple_parse_args_string(text)
  for name in ("num_loops", "batch_size", "max_gen_toks"):  # accepted: sound
    assert parsed.get(name) is None or (
      isinstance(parsed[name], int) and parsed[name] >= 1
    )


def _one_line_or_ok(code, lines, case, seconds=None, limit=None):
  assert code in (0, 2), (case, code, lines)
  if code == 2:
    assert len(lines) == 1 and lines[0].startswith("error: "), (case, lines)
    assert len(lines[0]) < 500, (case, lines)
  if limit is not None:
    assert seconds < limit, (case, f"{seconds:.1f} s")


# A workdir's records reshaped, as a hand edit, a copy cut short or a file from
# elsewhere leaves them: valid JSON of the wrong shape, or not JSON at all.
TINY = json.loads(config_lib.to_json(sysgen.get_config("tiny")))
_scalar = (
  st.none() | st.booleans() | st.integers(-3, 2**70) | st.floats() | st.text(max_size=6)
)
_junk = _scalar | st.lists(_scalar, max_size=3)  # never an object


def _paths(d, prefix=""):
  for k, v in d.items():
    yield prefix + k, v
    if isinstance(v, dict):
      yield from _paths(v, f"{prefix}{k}.")


_SECTIONS = sorted(p for p, v in _paths(TINY) if isinstance(v, dict))
_LEAVES = {p: v for p, v in _paths(TINY) if not isinstance(v, dict)}


def _of_another_type(default):
  """A JSON value whose type is not `default`'s (an int for a float is the
  same number, and for data.* would only make other data, slowly)."""
  if isinstance(default, bool):
    return _junk.filter(lambda v: not isinstance(v, bool))
  if isinstance(default, int | float):
    return _junk.filter(lambda v: isinstance(v, bool) or not isinstance(v, int | float))
  if isinstance(default, str):
    return _junk.filter(lambda v: not isinstance(v, str))
  return _scalar  # a list field: anything but a list


_edit = st.one_of(
  st.tuples(st.just("file"), _junk | st.binary(max_size=12)),
  st.tuples(st.just("section"), st.sampled_from(_SECTIONS), _junk),
  st.sampled_from(sorted(_LEAVES)).flatmap(
    lambda p: st.tuples(st.just("field"), st.just(p), _of_another_type(_LEAVES[p]))
  ),
  st.tuples(
    st.just("extra"),
    st.sampled_from(["", *_SECTIONS]),
    st.text(min_size=1, max_size=5),
    _junk,
  ),
  st.tuples(  # the data section's fields have defaults for other data
    st.just("missing"),
    st.sampled_from([p for p in _SECTIONS + sorted(_LEAVES) if p != "data"]),
  ),
)
_dataset = st.one_of(
  st.just({}),
  st.just({"sizes": {"train": 1}}),
  _junk.map(lambda v: {"fingerprint": v}),
  _junk,
  st.text(min_size=1, max_size=8).map(lambda v: {"fingerprint": v}),  # another's
  st.binary(max_size=8),
)


def _edited(config: dict, edits) -> dict | object:
  out = json.loads(json.dumps(config))
  for edit in edits:
    kind, *args = edit
    if kind == "file":
      return args[0]
    if not isinstance(out, dict):
      break
    *parents, last = (args[0].split(".") if args[0] else []) + (
      [args[1]] if kind == "extra" else []
    )
    node = out
    for k in parents:
      node = node.get(k) if isinstance(node, dict) else None
    if not isinstance(node, dict) or (kind != "extra" and last not in node):
      continue  # an earlier edit removed or replaced it
    if kind == "missing":
      del node[last]
    else:
      node[last] = args[-1]
  return out


def _write(path, value) -> None:
  if isinstance(value, bytes):
    path.write_bytes(value)
  else:
    path.write_text(json.dumps(value))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """The tiny config (as config.json holds it) with its data prepared once,
  and a language model's evaluation record for `--mode=report`."""
  root = tmp_path_factory.mktemp("records")
  config = TINY | {"data": TINY["data"] | {"data_dir": str(root / "data")}}
  (root / "run").mkdir()
  _write(root / "run" / "config.json", config)
  code, _ = main_in_process("--mode=eval", f"--workdir={root / 'run'}")
  assert code == 2  # no checkpoint yet; the data are prepared
  return root, config


_MODES = ("eval", "analyze", "report", "report_sweep", "train", "fork")
METRICS = '{"step": 1, "train/loss": 2.0, "eval/validation/loss": 1.5}\n'


def _check_records(prepared, mode, edits, dataset):
  root, config = prepared
  case = root / f"case{len(list(root.glob('case*')))}"
  run = case / "sweep" / "a" if mode == "report_sweep" else case / "run"
  run.mkdir(parents=True)
  _write(run / "config.json", _edited(config, edits))
  if dataset is not None:
    _write(run / "dataset.json", dataset)
  (run / "metrics").mkdir()
  (run / "metrics" / "0000000000001.jsonl").write_text(METRICS)
  given = ["--config=experiments/sysgen.py:tiny"]
  given.append(f"--config.data.data_dir={config['data']['data_dir']}")
  args = {
    "eval": ["--mode=eval", f"--workdir={run}"],
    "analyze": ["--mode=analyze", f"--workdir={run}"],
    "report": ["--mode=report", f"--workdir={run}"],
    "report_sweep": ["--mode=report", f"--workdir={run.parent}"],
    "train": [*given, f"--workdir={run}", "--config.train.num_steps=1"],
    "fork": [
      *given,
      f"--workdir={case / 'fork'}",
      f"--config.checkpoint.fork_from={run}",
    ],
  }[mode]
  if mode == "train" and dataset is None:  # it would train: no other data
    _write(run / "dataset.json", {"fingerprint": "another run's"})
  start = time.monotonic()
  code, lines = main_in_process(*args)
  _one_line_or_ok(code, lines, (mode, edits, dataset), time.monotonic() - start, 60)


@_settings(24)  # 200: -m slow
@given(
  st.sampled_from(_MODES), st.lists(_edit, min_size=1, max_size=3), st.none() | _dataset
)
def test_reshaped_workdir_records_are_one_line(prepared, mode, edits, dataset):
  """config.json and dataset.json of any shape, read by every mode that reads
  them (a run resumed or forked from, evaluated, analyzed, reported)."""
  _check_records(prepared, mode, edits, dataset)


@pytest.mark.slow
@_settings(200)
@given(
  st.sampled_from(_MODES), st.lists(_edit, min_size=1, max_size=3), st.none() | _dataset
)
def test_reshaped_workdir_records_many(prepared, mode, edits, dataset):
  _check_records(prepared, mode, edits, dataset)


# A value of another type on the command line: `--config.<field>=TEXT` where
# TEXT reads as another kind of value than the field's (what config_flags
# parses it to is its business; a one-line error or a run is ours).
_TEXTS = {
  int: st.integers(-3, 2**70).map(str),
  float: st.floats().map(repr) | st.sampled_from(["1e400", "-inf", "nan"]),
  bool: st.sampled_from(["True", "false", "yes"]),
  type(None): st.just("None"),
  str: st.text(alphabet="abcxyz_:/.-", max_size=6),
  tuple: st.lists(st.integers(-2, 5), max_size=3).map(lambda v: repr(tuple(v)))
  | st.sampled_from(["(", "((1, 2),)", "('a', None)", "[1, 'x']", "{}", "(1.5,)"]),
}
_CLI_FIELDS = sorted(set(FIELDS) - {"compile_cache"})  # where files go


def _other_text(field):
  default = FIELDS[field]
  own = {bool: bool, int: int, float: float, str: str}.get(type(default), tuple)
  others = [s for kind, s in _TEXTS.items() if kind is not own]
  if own is float:  # an integer is a number
    others.remove(_TEXTS[int])
  return st.one_of(others)


_typed_overrides = st.lists(
  st.sampled_from(_CLI_FIELDS).flatmap(lambda f: st.tuples(st.just(f), _other_text(f))),
  min_size=1,
  max_size=2,
)


def _check_typed(prepared, pairs):
  root, config = prepared
  flags = [f"--config.{f}={text}" for f, text in pairs]
  start = time.monotonic()
  code, lines = main_in_process(
    "--mode=eval",
    "--config=experiments/sysgen.py:tiny",
    f"--workdir={root / 'empty'}",
    f"--config.data.data_dir={config['data']['data_dir']}",
    *flags,
  )
  _one_line_or_ok(code, lines, flags, time.monotonic() - start, 60)


@_settings(30)  # 300: -m slow
@given(_typed_overrides)
def test_a_value_of_another_type_on_the_command_line_is_one_line(prepared, pairs):
  """Up to `--mode=eval`'s search for a checkpoint (an empty workdir): the
  data, the model's shapes, all read with the value."""
  _check_typed(prepared, pairs)


@pytest.mark.slow
@_settings(300)
@given(_typed_overrides)
def test_values_of_other_types_many(prepared, pairs):
  _check_typed(prepared, pairs)


# Sizes no machine holds, zero or negative, for the fields that size arrays:
# training refuses them before it compiles (validation, the data's own
# checks, footprint.py), in one line.
_SIZED = {
  "sysgen.py:tiny": (
    "train.batch_size",
    "model.d_model",
    "model.num_heads",
    "model.num_layers",
    "model.num_loops",
    "model.mlp_ratio",
    "data.num_entities",
    "data.num_relations",
    "data.out_degree",
  ),
  "lm.py:tiny": (
    "data.seq_len",
    "data.vocab_size",
    "train.batch_size",
    "model.d_model",
    "model.num_loops",
    "model.mlp_hidden",
    "model.num_prelude",
  ),
  "extrapolation.py:tiny": ("data.max_hops", "data.train_per_hop", "data.pad_to"),
}
_SIZES = st.sampled_from([0, -1, -(2**31), 2**31, 2**40, 2**63 - 1, 2**63, 10**30])
_ZERO_IS_OFF = {"model.mlp_hidden", "model.num_prelude", "data.pad_to"}  # a run
_sized = st.sampled_from(
  [(e, f) for e, fields in sorted(_SIZED.items()) for f in fields]
).flatmap(
  lambda ef: st.tuples(
    st.just(ef[0]),
    st.just(ef[1]),
    _SIZES.filter(lambda v: v != 0) if ef[1] in _ZERO_IS_OFF else _SIZES,
  )
)


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
  """A text corpus, its tokenizer trained once, and a workdir of the `tiny`
  language model that records them (config.json, tokenizer.json) with no
  checkpoint: what `python -m loopjax.sample` reads before the weights."""
  from conftest import write_corpus

  from experiments import lm
  from loopjax import task as task_lib

  root = tmp_path_factory.mktemp("lm")
  c = lm.get_config("tiny")
  c.data.source = f"text:{write_corpus(root / 'corpus')}/*.py"
  c.data.data_dir, c.data.valid_fraction = str(root / "data"), 0.2
  task = task_lib.for_config(c).load(c)
  (root / "run").mkdir()
  (root / "run" / "config.json").write_text(config_lib.to_json(c))
  (root / "run" / "tokenizer.json").write_text(task.tokenizer_json)
  return root / "run", c


def _check_size(prepared, lm_run, experiment, field, value):
  root, config = prepared
  data_dir = config["data"]["data_dir"]
  extra = [f"--config.data.data_dir={data_dir}"]
  if experiment.startswith("lm"):
    c = lm_run[1]
    extra = [
      f"--config.data.data_dir={c.data.data_dir}",
      f"--config.data.source={c.data.source}",
      "--config.data.valid_fraction=0.2",
    ]
  case = root / f"size{len(list(root.glob('size*')))}"
  start = time.monotonic()
  code, lines = main_in_process(
    f"--config=experiments/{experiment}",
    f"--workdir={case}",
    "--config.train.num_steps=1",
    *extra,
    f"--config.{field}={value}",
  )
  assert code == 2, (experiment, field, value, code, lines)  # none of them fits
  _one_line_or_ok(code, lines, (field, value), time.monotonic() - start, 30)


@_settings(24)  # 120: -m slow
@given(_sized)
def test_sizes_past_any_machine_are_one_line_before_compiling(prepared, lm_run, case):
  _check_size(prepared, lm_run, *case)


@pytest.mark.slow
@_settings(120)
@given(_sized)
def test_sizes_past_any_machine_many(prepared, lm_run, case):
  _check_size(prepared, lm_run, *case)


# `python -m loopjax.sample`'s numbers, up to the weights (the run has none):
# too many tokens for the model's positions is one line; so is any other.
_sample_args = st.fixed_dictionaries(
  {},
  optional={
    "max_new_tokens": _SIZES | st.integers(1, 200),
    "num_loops": _SIZES | st.integers(1, 8),
    "top_k": _SIZES,
    "temperature": st.sampled_from(["0", "-1", "1e308", "nan", "inf"]),
    "prompt": st.text(max_size=3).map(lambda t: t * 100),
  },
)


def _check_sample(lm_run, args):
  flags = [f"--{k}={v}" for k, v in args.items()]
  start = time.monotonic()
  code, lines = main_in_process(f"--workdir={lm_run[0]}", *flags, entry="sample")
  assert code == 2, (flags, code, lines)  # at most: no checkpoint to sample
  _one_line_or_ok(code, lines, flags, time.monotonic() - start, 30)


@_settings(20)  # 150: -m slow
@given(_sample_args)
def test_sample_counts_are_one_line(lm_run, args):
  _check_sample(lm_run, args)


@pytest.mark.slow
@_settings(150)
@given(_sample_args)
def test_sample_counts_many(lm_run, args):
  _check_sample(lm_run, args)


# Every absl entry point (`python -m loopjax.<entry>`, each through cli.run)
# given a bad input: a field that does not exist (one line that names what is
# near it, not the section's every field), a value a field refuses, a config
# file that does not exist, an argument too many. The harness's own command
# line: test_harness_model_args_are_one_line_or_accepted.
_ENTRIES = {
  "main": ("experiments/sysgen.py:tiny", ["--mode=eval", "--workdir={w}"]),
  "sample": ("experiments/lm.py:tiny", ["--workdir={w}"]),
  "aot": ("experiments/sysgen.py:tiny", ["--devices=1"]),
  "lm_eval": ("experiments/lm.py:tiny", ["--workdir={w}"]),
  "data": ("experiments/sysgen.py:tiny", ["export", "--out={w}"]),
  "bench": ("experiments/bench.py", ["step"]),
}
_IN_PROCESS = ("main", "sample", "aot")  # the others' flags clash: processes
_BASE = config_lib.base()
_REFUSED = [  # (field, value) that every experiment's validation refuses
  ("model.num_loops", "0"),
  ("model.d_model", "-1"),
  ("train.lr", "-1.0"),
  ("train.batch_size", "0"),
  ("eval.batch_size", "0"),
  ("log_every", "0"),
]
_faults = st.one_of(
  st.sampled_from(["model", "train", "data", "eval", "checkpoint"]).flatmap(
    lambda s: st.tuples(
      st.just("unknown"),
      st.just(s),
      st.text("abcdefghilmnoprstu_", min_size=1, max_size=12).filter(
        lambda k, s=s: k not in _BASE[s]
      ),
    )
  ),
  st.tuples(st.just("refused"), st.sampled_from(_REFUSED)),
  st.just(("no_file",)),
  st.just(("argument",)),
)


def _entry_argv(entry: str, fault: tuple, workdir) -> list[str]:
  config, args = _ENTRIES[entry]
  argv = [f"--config={config}", *(a.format(w=workdir) for a in args)]
  kind, *what = fault
  if kind == "unknown":
    argv.append(f"--config.{what[0]}.{what[1]}=1")
  elif kind == "refused":
    argv.append(f"--config.{what[0][0]}={what[0][1]}")
  elif kind == "no_file":
    argv[0] = "--config=experiments/no_such_experiment.py"
  else:
    argv.append("stray")
  return argv


def _check_entry(lines, code, seconds, case, fault, limit=30):
  assert code == 2, (case, code, lines)
  _one_line_or_ok(code, lines, case, seconds, limit)
  if fault[0] == "unknown":  # what is near the typo, never all 39 fields
    assert "no such field" in lines[0] and len(lines[0]) < 200, (case, lines)


@_settings(24)  # the slow tier runs every entry point as a process
@given(st.sampled_from(_IN_PROCESS), _faults)
def test_bad_input_at_an_entry_point_is_one_line(prepared, entry, fault):
  root, _ = prepared
  argv = _entry_argv(entry, fault, root / "entry")
  cache = jax.config.jax_enable_compilation_cache  # aot turns it off
  start = time.monotonic()
  try:
    code, lines = main_in_process(*argv, entry=entry)
  finally:
    jax.config.update("jax_enable_compilation_cache", cache)
  _check_entry(lines, code, time.monotonic() - start, (entry, argv), fault)


@pytest.mark.slow
@_settings(60)
@given(st.sampled_from(sorted(_ENTRIES)), _faults)
def test_bad_input_at_every_entry_point_is_one_line(prepared, entry, fault):
  """As `python -m loopjax.<entry>` runs, in its own process."""
  root, _ = prepared
  argv = _entry_argv(entry, fault, root / "entry")
  start = time.monotonic()
  proc = subprocess.run(
    [sys.executable, "-m", f"loopjax.{entry}", *argv],
    capture_output=True,
    text=True,
    env=CPU_ENV,
    timeout=120,
  )
  lines = proc.stderr.strip().splitlines()
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  seconds = time.monotonic() - start  # with a process's start: JAX's import
  _check_entry(lines, proc.returncode, seconds, (entry, argv), fault, limit=60)


# A model no target holds, from `python -m loopjax.aot`: refused before
# anything is lowered or built (a target's compiler aborts the process on
# such a program: libtpu, with nothing printed), in one line naming the
# field that sizes it. test_launch: the same on a TPU slice's chips.
_AOT_SIZED = (
  "model.d_model",
  "model.num_layers",
  "model.num_prelude",
  "model.num_coda",
  "model.mlp_ratio",
  "model.mlp_hidden",
  "data.vocab_size",
)
_aot_sized = st.tuples(
  st.sampled_from(_AOT_SIZED), st.sampled_from([2**31, 2**40, 2**63 - 1, 10**30])
)


def _check_aot_size(field, value, *flags):
  start = time.monotonic()
  cache = jax.config.jax_enable_compilation_cache
  code, lines = main_in_process(
    "--config=experiments/lm.py:tiny", f"--config.{field}={value}", *flags,
    entry="aot",
  )  # fmt: skip
  assert jax.config.jax_enable_compilation_cache == cache  # aot turned it back
  case = (field, value, flags)
  assert code == 2, (case, code, lines)
  _one_line_or_ok(code, lines, case, time.monotonic() - start, 30)
  assert field in lines[0], (case, lines)


@_settings(12)  # 80: -m slow
@given(_aot_sized)
def test_aot_refuses_a_model_no_device_holds_in_one_line(case):
  _check_aot_size(*case)


@pytest.mark.slow
@_settings(80)
@given(_aot_sized)
def test_aot_refuses_models_no_device_holds_many(case):
  _check_aot_size(*case)


def test_aot_names_the_models_width_when_its_state_alone_does_not_fit():
  """The issue's case on forced CPU devices: d_model 65536 (a 6 TB train
  state), and one whose parameters fit a device only if split, replicated
  over the data axis (the bound, which assumes an even split, passes it)."""
  _check_aot_size("model.d_model", 65536, "--config.model.num_heads=64")
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  # a state and gradient of 16 bytes a parameter, ~12 D^2 parameters (one
  # block): ~1.5x a device's share of the host (8 devices), replicated; the
  # bound splits ~10 D^2 evenly over the 8 devices: 0.16x, it passes
  width = int(math.sqrt(1.5 * host / 8 / 16 / 12)) // 128 * 128  # rope: even
  _check_aot_size(
    "model.d_model", width, "--config.model.num_heads=64", "--config.mesh.data=8"
  )


# A reading job's mesh (issue 53): whatever mesh a run trained on (any sizes
# validation allows, mesh.devices included), a job of one or several
# processes reads it on the devices it was launched on, never a refusal.
_trained_mesh = st.fixed_dictionaries(
  {
    "data": st.sampled_from([-1, 1, 2, 3, 4, 8, 16]),
    "fsdp": st.sampled_from([1, 2, 3, 4, 8]),
    "tensor": st.sampled_from([1, 2, 4, 5]),
    "devices": st.sampled_from([0, 1, 2, 4, 7]),
  }
)


@_settings(40)
@given(_trained_mesh, st.sampled_from([1, 2, 4]))
def test_a_reading_job_opens_any_trained_mesh_on_its_devices(mesh, processes):
  from unittest import mock

  from loopjax import restore

  c = sysgen.get_config("tiny")
  c.mesh.update(mesh)
  with mock.patch.object(jax, "process_count", lambda: processes):
    got = restore.job_mesh(c)
  n = mesh["devices"] if mesh["devices"] and processes == 1 else jax.device_count()
  assert got.devices.size == min(n, jax.device_count()), (mesh, processes)


# A typo in a field's name, on the command line: one line naming it, short
# however many fields its section has (issue 53: all 39 used to be listed),
# and naming the field meant where the typo is one edit from it.
def _typo(field: str):
  section, _, key = field.rpartition(".")
  edits = st.sampled_from(["drop", "double", "swap"]).flatmap(
    lambda how: st.integers(0, len(key) - 2).map(lambda i: (how, i))
  )

  def edit(case):
    how, i = case
    typo = {
      "drop": key[:i] + key[i + 1 :],
      "double": key[:i] + key[i] + key[i:],
      "swap": key[:i] + key[i + 1] + key[i] + key[i + 2 :],
    }[how]
    return field, f"{section}.{typo}" if section else typo

  return edits.map(edit)


_typos = st.sampled_from(sorted(f for f in FIELDS if len(f.rpartition(".")[2]) > 4))
_typos = _typos.flatmap(_typo).filter(lambda pair: pair[1] not in FIELDS)


def _check_typo(prepared, pair):
  field, typo = pair
  root, config = prepared
  start = time.monotonic()
  code, lines = main_in_process(
    "--config=experiments/sysgen.py:tiny",
    f"--workdir={root / 'typo'}",
    f"--config.{typo}=1",
  )
  _one_line_or_ok(code, lines, pair, time.monotonic() - start, 30)
  assert code == 2 and f"--config.{typo}: no such field" in lines[0], (pair, lines)
  assert len(lines[0]) < 250, lines
  assert not (root / "typo").exists()  # nothing written
  # one edit from a key of more than 4 characters: among difflib's 3 nearest
  # (a short section lists all its fields instead)
  assert field.rpartition(".")[2] in lines[0], (pair, lines)


@_settings(20)  # 200: -m slow
@given(_typos)
def test_a_typo_in_a_field_name_is_one_short_line(prepared, pair):
  _check_typo(prepared, pair)


@pytest.mark.slow
@_settings(200)
@given(_typos)
def test_typos_in_field_names_many(prepared, pair):
  _check_typo(prepared, pair)
