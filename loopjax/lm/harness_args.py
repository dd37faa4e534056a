"""The harness model `loopjax`'s arguments (`--model_args`), checked before a
weight is read and before the harness starts: one `ConfigError` line each.

The harness parses `k=v` into int, float and bool where it can, so what is
left a string was not one. Its own `--batch_size` reaches the model as the
string it was written as ("16", "auto", "auto:4"); loopjax has no memory
probe, so `auto` is `AUTO_BATCH_SIZE` (8), and says so when used.
"""

import dataclasses
import sys

from lm_eval import utils

from loopjax.errors import ConfigError
from loopjax.field_rules import ENUMS, MAX_ITERATIONS

MAX_GEN_TOKS = 256  # new tokens where a task does not say (the harness's hf model's)
AUTO_BATCH_SIZE = 8  # `batch_size=auto`: no memory probe, the constructor's default

# The least each counted argument may be.
_LEAST = {"num_loops": 1, "batch_size": 1, "max_length": 2, "max_gen_toks": 1,
          "r_min": 1, "step": 0, "seed": 0}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelArgs:
  """`--model_args` of `--model loopjax`, as the harness passes them; an
  unknown one is a TypeError (Python's), as for any harness model."""

  pretrained: str | None = None
  hf_dir: str | None = None
  workdir: str | None = None
  step: int | None = None
  num_loops: int | None = None
  exit: str | None = None
  threshold: float | None = None
  r_min: int = 1
  start: str = "uniform"
  batch_size: int | str = AUTO_BATCH_SIZE
  dtype: str = "float32"
  max_length: int | None = None
  max_gen_toks: int = MAX_GEN_TOKS
  add_bos_token: bool | None = None
  seed: int = 0
  record: str | None = None
  max_batch_size: int | None = None  # the harness's, for batch_size=auto
  device: str | None = None  # the harness's; JAX places the model

  def __post_init__(self):
    object.__setattr__(self, "batch_size", batch_size(self.batch_size))
    check(self)

  @property
  def model_dir(self) -> str | None:
    """The pretrained directory (`pretrained=` or its alias `hf_dir=`)."""
    return self.pretrained or self.hf_dir


def batch_size(value):
  """The harness's `--batch_size` string as a number: "auto" (or "auto:N")
  is AUTO_BATCH_SIZE, printed as it is chosen; anything else unparsed stays
  as given, for `check` to name."""
  if isinstance(value, str) and value.startswith("auto"):
    print(
      f"loopjax: batch_size={value} is {AUTO_BATCH_SIZE} (no memory probe; give a "
      "number to choose another)",
      file=sys.stderr,
    )
    return AUTO_BATCH_SIZE
  return int(value) if isinstance(value, str) and value.isdigit() else value


def _count(name: str, value, least: int = 1) -> None:
  """`value` must be None or an integer >= `least`."""
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < least:
    raise ConfigError(
      f"model_args: {name} must be an integer >= {least}; got {value!r}"
    )


def check(args: ModelArgs) -> None:
  """The arguments that take a number, a dtype or a flag; one line for the
  first bad one."""
  for name, least in _LEAST.items():
    _count(name, getattr(args, name), least)
  if (args.num_loops or 1) > MAX_ITERATIONS:
    raise ConfigError(
      f"model_args: num_loops must be <= {MAX_ITERATIONS} "
      f"(field_rules.MAX_ITERATIONS); got {args.num_loops}"
    )
  if args.dtype not in ENUMS["model.dtype"]:
    raise ConfigError(
      f"model_args: dtype must be one of {', '.join(ENUMS['model.dtype'])}; "
      f"got {args.dtype!r}"
    )
  if args.add_bos_token not in (None, True, False):
    raise ConfigError(
      f"model_args: add_bos_token must be True or False; got {args.add_bos_token!r}"
    )
  t = args.threshold
  if t is not None and (isinstance(t, bool) or not isinstance(t, int | float)):
    raise ConfigError(f"model_args: threshold must be a number; got {t!r}")
  if args.pretrained is not None and args.hf_dir is not None:
    raise ConfigError("model_args: give pretrained= or hf_dir= (the same), not both")


def flag(args: list[str], name: str) -> str | None:
  """The value of `--name V` or `--name=V` in a command line."""
  for i, a in enumerate(args):
    if a.startswith(name + "="):
      return a.split("=", 1)[1]
    if a == name and i + 1 < len(args):
      return args[i + 1]
  return None


def precheck(args: list[str]) -> None:
  """`--model loopjax`'s arguments in a harness command line, checked before
  the harness starts (and logs): one line for a bad one."""
  if flag(args, "--model") != "loopjax":
    return
  given = utils.simple_parse_args_string(flag(args, "--model_args") or "")
  names = [f.name for f in dataclasses.fields(ModelArgs)]
  if unknown := [k for k in given if k not in names]:
    raise ConfigError(
      f"--model_args: unknown argument {unknown[0]!r} (loopjax takes "
      f"{', '.join(names)})"
    )
  if "batch_size" not in given and (value := flag(args, "--batch_size")):
    given["batch_size"] = value  # the harness's own flag: a string
  if str(given.get("batch_size", "")).startswith("auto"):
    given["batch_size"] = AUTO_BATCH_SIZE  # said once, as the model is built
  ModelArgs(**given)
