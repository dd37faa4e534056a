"""The rules within one config section, which `config.validate` applies:
every field's value against its default's type, the model's shape
arithmetic, the mesh's sizes and sharding rules. The rules that relate
sections or need a family stay in config.py; a field alone, field_rules.py."""

from loopjax.errors import ConfigError

# What a field's default says of its values: (the default's type, the types a
# value may have, a value's name, a tuple's elements'). A bool is no number.
_KINDS = (
  (bool, (bool,), "true or false", "booleans"),
  (int, (int,), "an integer", "integers"),
  (float, (int, float), "a number", "numbers"),
  (str, (str,), "a string", "strings"),
)


def _is(value, types) -> bool:
  return isinstance(value, types) and (bool in types or not isinstance(value, bool))


def _kind(default):
  return next((k for k in _KINDS if isinstance(default, k[0])), None)


def types(c, reference, prefix: str = "") -> None:
  """Each field of `reference` (base()) holds a value of its default's type,
  and a tuple whose default's elements share a type, elements of it: a
  config.json edited by hand or an experiment's typo fails here in one line,
  not in the code that reads the field (None where a number goes, `true`
  where an integer does)."""
  for k, default in reference.items():
    if k not in c:
      continue
    value, field = c[k], prefix + k
    if hasattr(default, "items"):
      types(value, default, field + ".")
      continue
    if isinstance(default, tuple | list):
      kinds = {_kind(x) for x in default}
      inner = kinds.pop() if len(kinds) == 1 else None
      if not isinstance(value, tuple | list):
        wrong = f"a tuple{f' of {inner[3]}' if inner else ''}"
      elif inner and not all(_is(x, inner[1]) for x in value):
        wrong = f"a tuple of {inner[3]}"
      else:
        continue
    elif (kind := _kind(default)) is None:
      continue
    elif not _is(value, kind[1]):
      wrong = kind[2]
    elif isinstance(value, int) and not -(2**63) <= value < 2**63:
      wrong = "a 64-bit integer"  # numpy's and JAX's: larger ones overflow there
    else:
      continue
    raise ConfigError(f"{field}: must be {wrong}; got {_short(value)}")


def _short(value, limit: int = 80) -> str:
  text = repr(value)
  return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"


def model(m) -> None:
  """The model's shape arithmetic: heads, RoPE, positions, the state."""
  if m.d_model % m.num_heads:
    raise ConfigError(
      f"model.num_heads: must divide model.d_model ({m.d_model}); got {m.num_heads}"
    )
  if m.num_kv_heads and m.num_heads % m.num_kv_heads:
    raise ConfigError(
      f"model.num_kv_heads: must divide model.num_heads ({m.num_heads}); "
      f"got {m.num_kv_heads}"
    )
  if m.pos_encoding == "rope" and (m.d_model // m.num_heads) % 2:
    raise ConfigError(
      f"model.num_heads: rope needs an even head dimension (d_model / num_heads); "
      f"got {m.d_model} / {m.num_heads}"
    )
  if m.random_positions and m.pos_encoding != "rope":
    raise ConfigError(
      f"model.random_positions: must be 0 unless model.pos_encoding is 'rope' "
      f"(the positions it draws rotate queries and keys; {m.pos_encoding!r} "
      f"{'has no positions' if m.pos_encoding == 'none' else 'reads 0..T-1'}); "
      f"got {m.random_positions}"
    )
  if m.injection == "none" and m.init_state != "embedding":
    raise ConfigError(
      f"model.init_state: must be 'embedding' when model.injection is "
      f"'none' (else the core never sees the input); got {m.init_state!r}"
    )


def mesh(c) -> None:
  """What can be checked without devices (their count: `sharding.mesh_shape`)."""
  named = {a: c.mesh[a] for a in ("data", "fsdp", "tensor")}
  sizes = list(named.values())
  if sizes.count(-1) > 1 or any(
    not isinstance(s, int) or s == 0 or s < -1 for s in sizes
  ):
    raise ConfigError(
      "mesh: data, fsdp and tensor must be >= 1, at most one -1 (the remaining "
      f"devices); got {', '.join(f'{a}={s}' for a, s in named.items())}"
    )
  for rule in c.sharding.rules:
    pair = isinstance(rule, tuple | list) and len(rule) == 2
    axes = rule[1] if pair else "?"
    named = [] if axes is None else [axes] if isinstance(axes, str) else axes
    if (
      not pair
      or not isinstance(rule[0], str)
      or not isinstance(named, tuple | list)
      or any(x not in ("data", "fsdp", "tensor") for x in named)
    ):
      raise ConfigError(
        "sharding.rules: each must be (logical name, mesh axis or axes or None) "
        f"with mesh axes data, fsdp, tensor; got {rule!r}"
      )
