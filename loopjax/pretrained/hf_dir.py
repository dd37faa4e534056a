"""A Hugging Face model directory read without torch: config.json and the
tensors of `model.safetensors` or of the shards its index lists.

Tensors are memory-mapped by the `safetensors` package (numpy, bf16 through
ml_dtypes) and read one at a time, so loading never holds a float32 copy of
the whole model. Every problem is a one-line ConfigError naming the file or
the tensor.
"""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

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


class HfDir:
  """`config` (config.json as a dict) and the tensors, as `dtype` arrays
  (`take`), each read when asked for; weights=False: config.json alone.
  `path`: the directory, or `model.init_from`'s "hf:DIR"."""

  def __init__(self, path, dtype: str = "float32", weights: bool = True):
    self.path = Path(str(path).removeprefix("hf:")).expanduser()
    self.dtype = jnp.dtype(dtype)
    if not (self.path / "config.json").is_file():
      raise ConfigError(f"model.hf_dir: {self.path} has no config.json")
    try:
      self.config = json.loads((self.path / "config.json").read_text())
    except json.JSONDecodeError as e:
      raise ConfigError(f"{self.path / 'config.json'}: not JSON ({e})") from e
    self.files = self._weight_map() if weights else {}
    self._open: dict[str, object] = {}
    self.used: set[str] = set()

  def _weight_map(self) -> dict[str, str]:
    """{tensor name: file name}."""
    if (self.path / INDEX).is_file():
      files = json.loads((self.path / INDEX).read_text())["weight_map"]
      for f in sorted(set(files.values())):
        if not (self.path / f).is_file():
          raise ConfigError(f"{self.path / INDEX}: lists {f}, which is missing")
      return files
    if (self.path / SINGLE).is_file():
      with safe_open(self.path / SINGLE, framework="np") as f:
        return dict.fromkeys(f.keys(), SINGLE)
    raise ConfigError(f"model.hf_dir: {self.path} has no {SINGLE} or {INDEX}")

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
      self._open[file] = safe_open(self.path / file, framework="np")
    x = self._open[file].get_tensor(name)
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
