"""Config fuzzing: random overrides give a one-line ConfigError or a run that starts.

Values are drawn per field type, as the command line would parse them (a value
of the wrong type is the flag parser's one-line error, tested in test_config).
A config that validates must get through data generation, model construction,
tracing of the train step and a real evaluation without any other exception.
"""

import math

import jax
import pytest
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
    return st.sampled_from(allowed + ("", "grokked_json:/nonexistent")) | st.text(
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
  harness = pytest.importorskip("loopjax.lm.harness")
  from lm_eval import utils

  from loopjax.errors import ConfigError

  text = ",".join(f"{k}={v}" for k, v in args.items())
  try:
    harness._precheck(["--model", "loopjax", "--model_args", text])
  except ConfigError as e:
    assert len(str(e).splitlines()) == 1
    return
  parsed = utils.simple_parse_args_string(text)
  for name in ("num_loops", "batch_size", "max_gen_toks"):  # accepted: sound
    assert parsed.get(name) is None or (
      isinstance(parsed[name], int) and parsed[name] >= 1
    )
