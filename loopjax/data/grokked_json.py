"""The Grokked Transformers JSON directory format for 2-hop composition.

Lets loopjax train and evaluate on the very examples the papers' scripts made, and
hand ours back to their code. The format is described in DATA_FORMATS.md.
"""

import json
import re
from pathlib import Path

import numpy as np

from loopjax.config import ConfigError
from loopjax.data import kg

SPECIALS = ("<mask>", "<sep>", "<a>", "</a>", "<q>", "</q>")
# Our probe split names -> the papers' test.json types.
TYPES = {
  name: name.replace("test_inferred_id", "test_inferred_iid") for name in kg.PROBES
}
_TOKEN = re.compile(r"<[^<>]*>")
_SPACE = re.compile(r"\s*")
_OPENING = re.compile(r"\s*\[\s*(\]\s*)?")
_SEPARATOR = re.compile(r"\s*([,\]])\s*")


def _names(vocab: kg.Vocab) -> list[str]:
  return [f"<e_{i}>" for i in range(vocab.num_entities)] + [
    f"<r_{i}>" for i in range(vocab.num_relations)
  ]


def export(data: kg.TaskData, out_dir) -> None:
  """Writes train/valid/test/vocab.json; valid.json repeats the OOD inferred probe."""
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  names = _names(data.vocab) + [""]  # pad prints as nothing

  def items(split, type_=None):
    rows = zip(split["inputs"].tolist(), split["target"].tolist(), strict=True)
    for inputs, target in rows:
      text = "".join(names[i] for i in inputs)
      item = {"input_text": text, "target_text": f"{text}{names[target]}</a>"}
      yield item if type_ is None else item | {"type": type_}

  _write(out_dir / "vocab.json", names[:-1] + list(SPECIALS))
  _write(out_dir / "train.json", items(data.splits["train"]))
  _write(
    out_dir / "valid.json",
    items(data.splits["test_inferred_ood"], TYPES["test_inferred_ood"]),
  )
  _write(
    out_dir / "test.json",
    (item for name, type_ in TYPES.items() for item in items(data.splits[name], type_)),
  )


def _write(path: Path, items) -> None:
  """A JSON list with one item per line, so parse errors point at an example."""
  path.write_text("[\n" + ",\n".join(json.dumps(x) for x in items) + "\n]\n")


def load(dir_) -> kg.TaskData:
  """Reads a directory written by export() or by the papers' scripts."""
  dir_ = Path(dir_).expanduser()
  vocab = kg.Vocab(
    *(
      sum(
        bool(re.fullmatch(rf"<{kind}_\d+>", token))
        for _, token in _items(dir_ / "vocab.json", str)
      )
      for kind in "er"
    )
  )
  ids = {name: i for i, name in enumerate(_names(vocab))}
  ids |= {name: -1 - i for i, name in enumerate(SPECIALS)}
  train = _facts(dir_ / "train.json", vocab, ids)
  test = _facts(dir_ / "test.json", vocab, ids, types=tuple(TYPES.values()))
  tail_ER = _atomic_table(train, vocab)
  splits = {"train": _chain(train, tail_ER, vocab, "train.json")}
  for name, type_ in TYPES.items():
    rows = {k: v[test["type"] == type_] for k, v in test.items()}
    splits[name] = _chain(rows, tail_ER, vocab, "test.json")
  return kg.TaskData(vocab, splits)


def _items(path: Path, kind=dict):
  """Yields (line, item) for each item of the JSON list in path, parsed one by one."""
  try:
    text = path.read_text()
  except FileNotFoundError:
    raise ConfigError(f"{path}: missing file") from None
  except OSError as e:  # a directory, a path under a file, no permission
    raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None

  def fail(pos, message):
    line = text.count("\n", 0, pos) + 1
    return ConfigError(f"{path.name} line {line}: {message}")

  decoder = json.JSONDecoder()
  if not (opening := _OPENING.match(text)):
    raise fail(_SPACE.match(text).end(), "invalid JSON: expected a list")
  pos, end, line, counted = opening.end(), opening[1] is not None, 1, 0
  while not end:
    try:
      item, stop = decoder.raw_decode(text, pos)
    except json.JSONDecodeError as e:
      raise ConfigError(f"{path.name} line {e.lineno}: invalid JSON: {e.msg}") from None
    line, counted = line + text.count("\n", counted, pos), pos
    if not isinstance(item, kind):
      raise ConfigError(f"{path.name} line {line}: expected a JSON {kind.__name__}")
    yield line, item
    if not (separator := _SEPARATOR.match(text, stop)):
      raise fail(stop, "invalid JSON: expected ',' or ']'")
    pos, end = separator.end(), separator[1] == "]"
  if pos != len(text):
    raise fail(pos, "invalid JSON: extra data after the list")


def _facts(path: Path, vocab: kg.Vocab, ids: dict, types=None) -> dict:
  """Every example's token ids, checked, as columns plus its line and type."""
  rows = []
  for line, item in _items(path):
    try:
      rows.append((line, *_example(item, vocab, ids, types)))
    except ValueError as e:
      raise ConfigError(f"{path.name} line {line}: {e}") from None
  line, inputs, target, type_ = zip(*rows, strict=True) if rows else ([],) * 4
  return {
    "line": np.array(line, int),
    "inputs": np.array(inputs, np.int32).reshape(-1, 3),
    "target": np.array(target, np.int32),
    "type": np.array(type_, object),
  }


def _example(item: dict, vocab: kg.Vocab, ids: dict, types) -> tuple:
  text, target_text = item.get("input_text"), item.get("target_text")
  type_ = item.get("type")
  if not (isinstance(text, str) and isinstance(target_text, str)):
    raise ConfigError("input_text and target_text must be strings")
  if types and type_ not in types:
    raise ConfigError(f"unknown type {type_!r}; expected one of {', '.join(types)}")
  inputs, target = _token_ids(text, ids), _token_ids(target_text, ids)
  E = vocab.num_entities
  if not (
    len(inputs) in (2, 3)
    and 0 <= inputs[0] < E
    and all(E <= i < vocab.pad_id for i in inputs[1:])
  ):
    raise ConfigError("input_text must be one entity followed by one or two relations")
  if types and (len(inputs) == 2) != type_.endswith("_atomic"):
    raise ConfigError(f"type {type_!r} does not match a {len(inputs)}-token input")
  if not (
    target[:-2] == inputs
    and len(target) == len(inputs) + 2
    and 0 <= target[-2] < E
    and target[-1] == ids["</a>"]
  ):
    raise ConfigError("target_text must be input_text followed by one entity and </a>")
  return inputs + [vocab.pad_id] * (3 - len(inputs)), target[-2], type_


def _token_ids(text: str, ids: dict) -> list[int]:
  tokens = _TOKEN.findall(text)
  if "".join(tokens) != text:
    raise ConfigError(f"{text!r} is not a sequence of <...> tokens")
  for token in tokens:
    if token not in ids:
      raise ConfigError(f"unknown token {token!r}")
  return [ids[t] for t in tokens]


def _is_atomic(rows, vocab: kg.Vocab) -> np.ndarray:
  return rows["inputs"][:, 2] == vocab.pad_id


def _atomic_table(train, vocab: kg.Vocab) -> np.ndarray:
  """tail_ER[h, r]: the tail of atomic fact (h, r) in train.json, -1 if absent."""
  atomic = _is_atomic(train, vocab)
  h, r = train["inputs"][atomic, 0], train["inputs"][atomic, 1] - vocab.num_entities
  tail_ER = np.full((vocab.num_entities, vocab.num_relations), -1, np.int32)
  tail_ER[h, r] = train["target"][atomic]
  clash = np.flatnonzero(tail_ER[h, r] != train["target"][atomic])
  if len(clash):
    raise ConfigError(
      f"train.json line {train['line'][atomic][clash[0]]}: another "
      "atomic fact gives this head and relation a different tail"
    )
  return tail_ER


def _chain(rows, tail_ER, vocab: kg.Vocab, file: str) -> kg.Split:
  """Checks each fact against train.json's atomic facts; finds inferred bridges."""
  E, inputs_N3 = vocab.num_entities, rows["inputs"]
  atomic_N = _is_atomic(rows, vocab)
  first_N = tail_ER[inputs_N3[:, 0], inputs_N3[:, 1] - E]
  r2_N = np.where(atomic_N, 0, inputs_N3[:, 2] - E)
  second_N = np.where(first_N < 0, -1, tail_ER[np.maximum(first_N, 0), r2_N])
  bad = np.flatnonzero(np.where(atomic_N, first_N, second_N) != rows["target"])
  if len(bad):
    raise ConfigError(
      f"{file} line {rows['line'][bad[0]]}: the answer does not "
      "follow from the atomic facts in train.json"
    )
  return {
    "inputs": inputs_N3,
    "target": rows["target"],
    "bridge": np.where(atomic_N, -1, first_N).astype(np.int32),
  }
