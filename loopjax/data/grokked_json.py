"""The papers' JSON directory formats: Grokked Transformers' 2-hop composition and
LTG's k-hop chains.

Lets loopjax train and evaluate on the very examples the papers' scripts made, and
hand ours back to their code. The formats are described in docs/data_formats.md.
Files are read as the papers' scripts write them (one `json.dump` line) or as
`export` writes them (one item a line); an error names the file, the item's
index in its list and, where the file has several lines, the line.
"""

import json
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from loopjax.data import kg
from loopjax.errors import ConfigError

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
  """Writes the papers' files for the task (docs/data_formats.md)."""
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
  if data.task == "chains":
    return _export_chains(data, out_dir, items)
  _write(out_dir / "train.json", items(data.splits["train"]))
  _write(
    out_dir / "valid.json",
    items(data.splits["test_inferred_ood"], TYPES["test_inferred_ood"]),
  )
  _write(
    out_dir / "test.json",
    (item for name, type_ in TYPES.items() for item in items(data.splits[name], type_)),
  )


def _export_chains(data: kg.TaskData, out_dir: Path, items) -> None:
  """LTG's k-hop files: train.json (atomic, then every train chain), test.json
  (every test chain, 2000 sampled atomic facts, up to 2000 sampled train chains
  per k), valid.json (a copy), test_small.json (50 test chains per k)."""
  ks = range(2, data.max_hops + 1)
  sp = data.splits

  def chained(*parts):
    for part in parts:
      yield from part

  _write(
    out_dir / "train.json",
    chained(
      items(sp["atomic"], "atomic"),
      *(items(sp[f"train_k{k}"], f"{k}hop_train") for k in ks),
    ),
  )
  test = list(
    chained(
      *(items(sp[f"test_k{k}"], f"{k}hop_test") for k in ks),
      items(kg.sample(sp["atomic"], 2000, 1), "atomic_facts"),
      *(items(kg.sample(sp[f"train_k{k}"], 2000, k), f"{k}hop_train") for k in ks),
    )
  )
  _write(out_dir / "test.json", test)
  _write(out_dir / "valid.json", test)
  _write(
    out_dir / "test_small.json",
    chained(*(items(kg.sample(sp[f"test_k{k}"], 50, k), f"{k}hop_test") for k in ks)),
  )


def _write(path: Path, items) -> None:
  """A JSON list with one item per line, so parse errors point at an example."""
  path.write_text("[\n" + ",\n".join(json.dumps(x) for x in items) + "\n]\n")


def load(dir_, task: str = "composition") -> kg.TaskData:
  """Reads a directory written by export() or by the papers' scripts."""
  dir_ = Path(dir_).expanduser()
  vocab = kg.Vocab(
    *(
      sum(
        bool(re.fullmatch(rf"<{kind}_\d+>", token))
        for _, _, token in _items(dir_ / "vocab.json", str)
      )
      for kind in "er"
    )
  )
  ids = {name: i for i, name in enumerate(_names(vocab))}
  ids |= {name: -1 - i for i, name in enumerate(SPECIALS)}
  if task == "chains":
    return _load_chains(dir_, vocab, ids)
  train = _facts(dir_ / "train.json", vocab, ids, lambda _: None, width=3)
  test = _facts(dir_ / "test.json", vocab, ids, _composition_len, width=3)
  tail_ER = _atomic_table(train, vocab)
  splits = {"train": _composition(train, tail_ER, vocab, "train.json")}
  for name, type_ in TYPES.items():
    rows = {k: v[test["type"] == type_] for k, v in test.items()}
    splits[name] = _composition(rows, tail_ER, vocab, "test.json")
  return kg.TaskData(vocab, splits, "composition")


def _composition_len(type_) -> int:
  """The input length a test.json type implies."""
  if type_ not in TYPES.values():
    raise ValueError(
      f"unknown type {type_!r}; expected one of {', '.join(TYPES.values())}"
    )
  return 2 if type_.endswith("_atomic") else 3


_HOP_TYPE = re.compile(r"(\d+)hop_(train|test)")


def _chain_kind(type_, atomic: str, splits: tuple[str, ...]) -> tuple[str, int]:
  """(split, the hop count the label names) of a k-hop file's type: `atomic`
  for atomic facts (1 hop), `<k>hop_<split>` for chains. The label's count is
  not trusted (LTG's create_dataset.py labels train.json's k-hop chains
  `<k-2>hop_train`): the chain's own length decides."""
  if type_ == atomic:
    return "atomic", 1
  m = _HOP_TYPE.fullmatch(type_) if isinstance(type_, str) else None
  if not (m and m[2] in splits):
    kinds = " or ".join(f"<k>hop_{s}" for s in splits)
    raise ValueError(f"unknown type {type_!r}; expected {atomic} or {kinds}")
  return m[2], int(m[1])


def _load_chains(dir_: Path, vocab: kg.Vocab, ids: dict) -> kg.TaskData:
  """Atomic facts and train chains from train.json, test chains from test.json
  (its sampled atomic facts and train chains repeat train.json's)."""
  train = _typed_chains(dir_ / "train.json", vocab, ids, "atomic", ("train",))
  test = _typed_chains(
    dir_ / "test.json", vocab, ids, "atomic_facts", ("test", "train")
  )
  bad = np.flatnonzero((test["split"] == "test") & (test["hops"] < 2))
  if len(bad):
    raise ConfigError(
      f"{_place('test.json', test, bad[0])}: a test chain needs >= 2 hops"
    )
  K = max(train["inputs"].shape[1], test["inputs"].shape[1]) - 1
  tail_ER = _atomic_table(train, vocab)
  hops = train["hops"]
  splits = {"atomic": _chains(train, tail_ER, vocab, "train.json", K, hops == 1)}
  for k in range(2, K + 1):
    splits[f"train_k{k}"] = _chains(train, tail_ER, vocab, "train.json", K, hops == k)
    in_test = (test["split"] == "test") & (test["hops"] == k)
    splits[f"test_k{k}"] = _chains(test, tail_ER, vocab, "test.json", K, in_test)
  return kg.TaskData(vocab, splits, "chains")


def _typed_chains(path: Path, vocab, ids, atomic: str, splits) -> dict:
  """A k-hop file's rows with each one's split and hop count (its chain's);
  labels that name another count are reported once, with counts."""
  rows = _facts(path, vocab, ids, None, width=2)
  kinds = []
  for i, type_ in enumerate(rows["type"]):
    try:
      kinds.append(_chain_kind(type_, atomic, splits))
    except ValueError as e:
      raise ConfigError(f"{_place(path.name, rows, i)}: {e}") from None
  split, named = zip(*kinds, strict=True) if kinds else ((), ())
  rows["split"] = np.array(split, object)
  rows["hops"] = (rows["inputs"] != vocab.pad_id).sum(1) - 1
  off = Counter(
    (t, int(h))
    for t, h, n in zip(rows["type"], rows["hops"], named, strict=True)
    if h != n
  )
  if off:
    (t, h), _ = off.most_common(1)[0]
    print(
      f"warning: {path.name}: {sum(off.values())} of {len(named)} items are "
      f"labelled with another hop count than their chain has ({len(off)} labels, "
      f"e.g. {t!r} on {h}-hop chains; LTG's create_dataset.py labels k-hop train "
      "chains '<k-2>hop_train'); each counts as its chain's hops",
      file=sys.stderr,
    )
  return rows


def _place(file: str, rows: dict, i: int) -> str:
  """Where row i came from: its index in the file's list and, when the file
  has several lines, its line."""
  line = rows["line"][i]
  return f"{file} item {rows['index'][i]}" + (f" (line {line})" if line > 1 else "")


def _items(path: Path, kind=dict):
  """Yields (index, line, item) for each item of the JSON list in path, parsed
  one by one."""
  try:
    text = path.read_text()
  except FileNotFoundError:
    raise ConfigError(f"{path}: missing file") from None
  except OSError as e:  # a directory, a path under a file, no permission
    raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None

  def fail(pos, message, index=None):
    line = text.count("\n", 0, pos) + 1
    where = f" item {index}" if index is not None else ""
    where += f" (line {line})" if line > 1 else f" (character {pos})"
    return ConfigError(f"{path.name}{where}: {message}")

  decoder = json.JSONDecoder()
  if not (opening := _OPENING.match(text)):
    raise fail(_SPACE.match(text).end(), "invalid JSON: expected a list")
  pos, end, line, counted = opening.end(), opening[1] is not None, 1, 0
  index = 0
  while not end:
    try:
      item, stop = decoder.raw_decode(text, pos)
    except json.JSONDecodeError as e:
      raise fail(e.pos, f"invalid JSON: {e.msg}", index) from None
    line, counted = line + text.count("\n", counted, pos), pos
    if not isinstance(item, kind):
      raise fail(pos, f"expected a JSON {kind.__name__}", index)
    yield index, line, item
    if not (separator := _SEPARATOR.match(text, stop)):
      raise fail(stop, "invalid JSON: expected ',' or ']'", index)
    pos, end, index = separator.end(), separator[1] == "]", index + 1
  if pos != len(text):
    raise fail(pos, "invalid JSON: extra data after the list")


def _facts(path: Path, vocab: kg.Vocab, ids: dict, length, width: int = 0) -> dict:
  """Every example's token ids, checked, as columns (inputs padded to the longest,
  at least `width`) plus its index, line and type; `length(type)` is the input
  length the type implies (None: up to 3 tokens); `length` None: any length."""
  rows = []
  for index, line, item in _items(path):
    try:
      rows.append((index, line, *_example(item, vocab, ids, length)))
    except ValueError as e:
      where = f"item {index}" + (f" (line {line})" if line > 1 else "")
      raise ConfigError(f"{path.name} {where}: {e}") from None
  index, line, inputs, target, type_ = zip(*rows, strict=True) if rows else ([],) * 5
  T = max([width, *map(len, inputs)])
  return {
    "index": np.array(index, int),
    "line": np.array(line, int),
    "inputs": np.array(
      [x + [vocab.pad_id] * (T - len(x)) for x in inputs], np.int32
    ).reshape(-1, T),
    "target": np.array(target, np.int32),
    "type": np.array(type_, object),
  }


def _example(item: dict, vocab: kg.Vocab, ids: dict, length) -> tuple:
  text, target_text = item.get("input_text"), item.get("target_text")
  type_ = item.get("type")
  if not (isinstance(text, str) and isinstance(target_text, str)):
    raise ConfigError("input_text and target_text must be strings")
  want = length(type_) if length is not None else None
  inputs, target = _token_ids(text, ids), _token_ids(target_text, ids)
  E = vocab.num_entities
  if not (
    len(inputs) >= 2
    and (want is not None or length is None or len(inputs) <= 3)
    and 0 <= inputs[0] < E
    and all(E <= i < vocab.pad_id for i in inputs[1:])
  ):
    raise ConfigError(
      "input_text must be one entity followed by "
      + ("one or two relations" if want is None and length else "relations")
    )
  if want is not None and len(inputs) != want:
    raise ConfigError(f"type {type_!r} does not match a {len(inputs)}-token input")
  if not (
    target[:-2] == inputs
    and len(target) == len(inputs) + 2
    and 0 <= target[-2] < E
    and target[-1] == ids["</a>"]
  ):
    raise ConfigError("target_text must be input_text followed by one entity and </a>")
  return inputs, target[-2], type_


def _token_ids(text: str, ids: dict) -> list[int]:
  tokens = _TOKEN.findall(text)
  if "".join(tokens) != text:
    raise ConfigError(f"{text!r} is not a sequence of <...> tokens")
  for token in tokens:
    if token not in ids:
      raise ConfigError(f"unknown token {token!r}")
  return [ids[t] for t in tokens]


def _atomic_table(train, vocab: kg.Vocab) -> np.ndarray:
  """tail_ER[h, r]: the tail of atomic fact (h, r) in train.json, -1 if absent."""
  atomic = (train["inputs"] != vocab.pad_id).sum(1) == 2
  h, r = train["inputs"][atomic, 0], train["inputs"][atomic, 1] - vocab.num_entities
  tail_ER = np.full((vocab.num_entities, vocab.num_relations), -1, np.int32)
  tail_ER[h, r] = train["target"][atomic]
  clash = np.flatnonzero(tail_ER[h, r] != train["target"][atomic])
  if len(clash):
    where = _place(
      "train.json", {k: train[k][atomic] for k in ("index", "line")}, clash[0]
    )
    raise ConfigError(
      f"{where}: another atomic fact gives this head and relation a different tail"
    )
  return tail_ER


def _walk(rows, tail_ER, vocab: kg.Vocab, file: str):
  """(entities reached after hops 1..T-1 (N, T-1), -1 past the end; hops (N,)),
  checking that every answer follows from train.json's atomic facts."""
  (E, R), inputs_NT = tail_ER.shape, rows["inputs"]
  hops_N = (inputs_NT != vocab.pad_id).sum(1) - 1
  e_N, walk = inputs_NT[:, 0], []
  for j in range(1, inputs_NT.shape[1]):
    live_N = (j <= hops_N) & (e_N >= 0)
    e_N = np.where(
      live_N, tail_ER[np.maximum(e_N, 0), np.minimum(inputs_NT[:, j] - E, R - 1)], -1
    )
    walk.append(e_N)
  walk_NJ = np.stack(walk, 1) if walk else np.zeros((len(hops_N), 0), np.int32)
  answer_N = walk_NJ[np.arange(len(hops_N)), hops_N - 1] if len(hops_N) else hops_N
  bad = np.flatnonzero(answer_N != rows["target"])
  if len(bad):
    raise ConfigError(
      f"{_place(file, rows, bad[0])}: the answer does not follow from the atomic "
      "facts in train.json"
    )
  return walk_NJ, hops_N


def _composition(rows, tail_ER, vocab: kg.Vocab, file: str) -> kg.Split:
  """Checks each fact against train.json's atomic facts; finds inferred bridges."""
  walk_N2, hops_N = _walk(rows, tail_ER, vocab, file)
  return {
    "inputs": rows["inputs"],
    "target": rows["target"],
    "bridge": np.where(hops_N == 1, -1, walk_N2[:, 0]).astype(np.int32),
  }


def _chains(rows, tail_ER, vocab: kg.Vocab, file: str, K: int, keep) -> kg.Split:
  """The rows `keep` selects, padded to K hops, checked, with their bridges."""
  rows = {k: v[keep] for k, v in rows.items()}
  pad = np.full((len(rows["target"]), K + 1 - rows["inputs"].shape[1]), vocab.pad_id)
  rows["inputs"] = np.concatenate([rows["inputs"], pad], 1).astype(np.int32)
  walk_NK, hops_N = _walk(rows, tail_ER, vocab, file)
  j_K = np.arange(K - 1)
  bridges = np.where(j_K[None] < hops_N[:, None] - 1, walk_NK[:, : K - 1], -1)
  return {
    "inputs": rows["inputs"],
    "target": rows["target"],
    "bridges": bridges.astype(np.int32),
  }
