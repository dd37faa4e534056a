"""A Hugging Face model directory read without torch: config.json (as
transformers 4.x and 5.x write it) and the tensors of `model.safetensors` or
of the shards its index lists.

Tensors are memory-mapped by the `safetensors` package (numpy, bf16 through
ml_dtypes) and read one at a time, so loading never holds a float32 copy of
the whole model. Every problem is a one-line ConfigError naming the file or
the tensor.
"""

import contextlib
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from loopjax.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def check_config(hf: dict, architecture: str, fixed: dict) -> None:
  """config.json names `architecture`, and each field of `fixed` is absent or
  holds the one value the family supports."""
  arch = (hf.get("architectures") or [architecture])[0]
  if arch != architecture:
    raise ConfigError(
      f"config.json: architectures must be [{architecture!r}] for model_type "
      f"{hf.get('model_type')!r}; got {arch!r}"
    )
  for field, value in fixed.items():
    if hf.get(field, value) != value:
      raise ConfigError(
        f"config.json: {field} must be {value!r} (not supported otherwise); "
        f"got {hf[field]!r}"
      )


# What a rope_parameters (transformers 5) or rope_scaling (4.x) dict may hold;
# anything else is a field loopjax would not honour.
ROPE_KEYS = {"rope_theta", "rope_type", "type", "factor", "low_freq_factor",
             "high_freq_factor", "original_max_position_embeddings",
             "partial_rotary_factor"}  # fmt: skip
# The rope_types transformers' Llama accepts; loopjax computes the first two.
ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "longrope",
              "proportional")  # fmt: skip


def rope(hf: dict, default_theta: float | None, theta_key: str = "rope_theta"):
  """(RoPE base, the llama3 rescaling dict or None) of config.json `hf`.

  transformers 5 writes `rope_parameters: {rope_theta, rope_type, ...}` and no
  top-level `rope_theta` or `rope_scaling`; 4.x writes those two (a remote
  model's config may carry both). Each is read where either version puts it;
  two places that disagree are an error, as is a key or a rope_type loopjax
  does not compute. `default_theta`: what transformers takes for this model
  type when no base is written (None: the base is required)."""
  params, legacy = hf.get("rope_parameters"), hf.get("rope_scaling")
  for name, d in (("rope_parameters", params), ("rope_scaling", legacy)):
    if d is not None and not isinstance(d, dict):
      raise ConfigError(f"config.json: {name} must be an object; got {d!r}")
    if unknown := sorted(set(d or {}) - ROPE_KEYS):
      raise ConfigError(
        f"config.json: {name}.{unknown[0]} is not supported (per-layer RoPE or a "
        f"scaling loopjax does not compute); it reads {', '.join(sorted(ROPE_KEYS))}"
      )
  merged = dict(legacy or {})
  for key, value in (params or {}).items():
    if key in merged and merged[key] != value:
      raise ConfigError(
        f"config.json: rope_parameters.{key} ({value!r}) and rope_scaling.{key} "
        f"({merged[key]!r}) disagree"
      )
    merged[key] = value
  top = hf.get(theta_key)
  if top is not None and merged.get("rope_theta", top) != top:
    raise ConfigError(
      f"config.json: {theta_key} ({top!r}) and rope_parameters."
      f"rope_theta ({merged['rope_theta']!r}) disagree"
    )
  theta = merged.get("rope_theta", default_theta if top is None else top)
  if theta is None:
    raise ConfigError(
      f"config.json: {theta_key} is missing, here and in rope_parameters (the "
      "RoPE base it needs)"
    )
  partial = merged.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
  if partial is not None and float(partial) != 1.0:
    raise ConfigError(
      "config.json: partial_rotary_factor must be 1.0 (RoPE on part of each "
      "head is not supported)"
    )
  kinds = {key: merged[key] for key in ("rope_type", "type") if key in merged}
  if len(set(kinds.values())) > 1:  # 5.x's name and 4.x's, one field
    raise ConfigError(
      f"config.json: rope_type ({kinds['rope_type']!r}) and type "
      f"({kinds['type']!r}) disagree (the 5.x and 4.x names of one field)"
    )
  kind = next(iter(kinds.values()), "default")
  if kind not in ROPE_TYPES[:2]:
    known = kind in ROPE_TYPES
    raise ConfigError(
      f"config.json: rope_type {kind!r} is "
      + ("not supported" if known else "not one transformers knows")
      + " (loopjax computes 'default' and 'llama3')"
    )
  return float(theta), merged if kind == "llama3" else None


class HfDir:
  """`config` (config.json as a dict) and the tensors, as `dtype` arrays
  (`take`), each read when asked for; weights=False: config.json alone.
  `path`: the directory, or `model.init_from`'s "hf:DIR". The files `take`
  maps stay open until `close` (or the end of a `with` block); each array it
  returns is a copy, valid after."""

  def __init__(self, path, dtype: str = "float32", weights: bool = True):
    self.path = Path(str(path).removeprefix("hf:")).expanduser()
    self.dtype = jnp.dtype(dtype)
    if not (self.path / "config.json").is_file():
      raise ConfigError(f"model.hf_dir: {self.path} has no config.json")
    self.config = _json(self.path / "config.json")
    if not isinstance(self.config, dict):
      raise ConfigError(
        f"{self.path / 'config.json'}: must be a JSON object; got "
        f"{type(self.config).__name__}"
      )
    self.files = self._weight_map() if weights else {}
    self._open: dict[str, object] = {}
    self._stack = contextlib.ExitStack()  # the open files, closed together
    self.used: set[str] = set()

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Unmaps every file `take` opened (a later `take` opens it again)."""
    self._open.clear()
    self._stack.close()

  def stored(self) -> set[str]:
    """The names of the tensors the directory holds, listed also where it
    was read with weights=False (none where it has no weights: a shape)."""
    if self.files or not any((self.path / f).is_file() for f in (INDEX, SINGLE)):
      return set(self.files)
    return set(self._weight_map())

  def _weight_map(self) -> dict[str, str]:
    """{tensor name: file name}: the index's, or the one file's names."""
    if (self.path / INDEX).is_file():
      return self._index()
    if (self.path / SINGLE).is_file():
      with self._safe_open(SINGLE) as f:
        return dict.fromkeys(f.keys(), SINGLE)
    raise ConfigError(f"model.hf_dir: {self.path} has no {SINGLE} or {INDEX}")

  def _index(self) -> dict[str, str]:
    """The index's weight_map, checked: tensor name -> a file beside it."""
    index = self.path / INDEX
    files = _json(index)
    files = files.get("weight_map") if isinstance(files, dict) else None
    if files is None:
      raise ConfigError(f"{index}: has no weight_map (tensor name -> file)")
    if not isinstance(files, dict) or not files:
      raise ConfigError(
        f"{index}: weight_map must be a non-empty object of tensor name -> "
        f"file; got {type(files).__name__} {str(files)[:40]}"
      )
    for name, f in files.items():
      if not isinstance(f, str) or Path(f).name != f:
        raise ConfigError(
          f"{index}: weight_map.{name} must name a file in the directory; got {f!r}"
        )
    for f in sorted(set(files.values())):
      if not (self.path / f).is_file():
        raise ConfigError(f"{index}: lists {f}, which is missing")
    return files

  def _safe_open(self, file: str):
    """`file` memory-mapped by safetensors (not one: a one-line error)."""
    try:
      return safe_open(self.path / file, framework="np")
    except SafetensorError as e:
      raise ConfigError(f"{self.path / file}: not a safetensors file ({e})") from None

  def unused(self) -> list[str]:
    """The tensors no `take` (or `skip`) asked for, sorted."""
    return sorted(set(self.files) - self.used)

  def skip(self, name: str) -> None:
    """Marks a stored tensor the model does not need (e.g. a RoPE table)."""
    self.used.add(name)

  def take(self, name: str, shape: tuple) -> np.ndarray:
    """The tensor `name` as `dtype`; it must exist and have `shape`."""
    self.used.add(name)
    return np.asarray(self.tensor(name, shape), self.dtype)

  def zeros(self, *shape) -> np.ndarray:
    """A parameter the checkpoint does not store (a bias it has not)."""
    return np.zeros(shape, self.dtype)

  def tensor(self, name: str, shape: tuple) -> np.ndarray:
    """The tensor `name`, which must have `shape` (its stored dtype)."""
    if name not in self.files:
      raise ConfigError(f"{self.path}: tensor {name} is missing")
    file = self.files[name]
    if file not in self._open:
      self._open[file] = self._stack.enter_context(self._safe_open(file))
    try:
      x = self._open[file].get_tensor(name)
    except SafetensorError as e:  # an index that places it in the wrong file
      raise ConfigError(f"{self.path / file}: tensor {name} ({e})") from None
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ConfigError(
        f"{self.path / file}: tensor {name} is stored as {x.dtype}; the model "
        "needs floating-point weights"
      )
    if tuple(x.shape) != tuple(shape):
      raise ConfigError(
        f"{self.path / file}: tensor {name} has shape {tuple(x.shape)}, "
        f"the config needs {tuple(shape)}"
      )
    return x


def _json(file: Path):
  """The JSON value in `file` (not JSON: a one-line error)."""
  try:
    return json.loads(file.read_text())
  except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
    raise ConfigError(f"{file}: not JSON ({e})") from None
