"""Text corpora for the language-model task: which documents `data.source` names.

  stdlib         the running Python's standard library sources (offline, on
                 every machine with Python; tests and site-packages left out)
  bigram_backcopy
                 Guo et al. 2024's Bigram-Backcopy task (`bigram_backcopy`),
                 generated from data.seed: the positive control of the
                 attention-sink analyses
  text:GLOB      local files: .jsonl (one JSON object per line, its
                 `data.text_field` a document), anything else one document per file
  tfds:NAME[:CONFIG]
                 a TFDS text dataset prepared under data.data_dir in
                 array_record format (its `data.text_field` feature), read from
                 its directory without its builder code

A corpus is named by its fingerprint (sha256 over every document's key and
text), so a changed file is a different corpus; documents come in key order.
"""

import dataclasses
import glob
import hashlib
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from loopjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Corpus:
  source: str
  docs: tuple[tuple[str, str], ...]  # (key, text), sorted by key
  validation: tuple[tuple[str, str], ...] = ()  # a source's own held-out split

  @property
  def fingerprint(self) -> str:
    h = hashlib.sha256()
    for split, docs in (("train", self.docs), ("validation", self.validation)):
      for key, text in docs:
        h.update(f"|{split}|{key}|{len(text)}|".encode())
        h.update(text.encode())
    return h.hexdigest()


def load(data_cfg) -> Corpus:
  source = data_cfg.source
  if source == "stdlib":
    return Corpus(source, tuple(_stdlib()))
  if source == "bigram_backcopy":
    return Corpus(source, tuple(bigram_backcopy(data_cfg.seed)))
  if source.startswith("text:"):
    return Corpus(source, tuple(_text(source.removeprefix("text:"), data_cfg)))
  return _tfds(source.removeprefix("tfds:"), data_cfg)  # config.validate: nothing else


def _stdlib() -> Iterator[tuple[str, str]]:
  root = Path(sysconfig.get_paths()["stdlib"])
  for path in sorted(root.rglob("*.py")):
    rel = path.relative_to(root)
    if {"site-packages", "test", "tests", "idle_test"} & set(rel.parts):
      continue
    try:
      text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
      continue  # a few sources declare other encodings; not worth a run failing
    if text.strip():
      yield str(rel), text


# Bigram-Backcopy's size: 64 symbols, 3 of them triggers, 4096 documents.
BB_SYMBOLS = "".join(chr(c) for c in range(ord("0"), ord("0") + 64))
BB_TRIGGERS = 3
BB_DOCS, BB_LENGTH = 4096, 126


def bigram_backcopy(seed: int) -> Iterator[tuple[str, str]]:
  """Guo et al. 2024 ("Active-Dormant Attention Heads"): each symbol follows
  the one before it by a fixed random bigram table, except after a trigger,
  which is followed by the symbol before it. Only a trigger's successor needs
  attention; elsewhere a head has nothing to read, and it parks its attention
  on <bos>: a sink by construction. One ASCII character per symbol, so a
  byte-level tokenizer at data.vocab_size=259 (no merges) maps each to a token.
  """
  rng = np.random.default_rng(seed)
  V = len(BB_SYMBOLS)
  cdf_VV = np.cumsum(rng.dirichlet(np.full(V, 0.3), V), 1)  # few likely successors
  trigger_V = np.zeros(V, bool)
  trigger_V[rng.choice(V, BB_TRIGGERS, replace=False)] = True
  first_N = rng.choice(np.flatnonzero(~trigger_V), BB_DOCS)
  u_NL = rng.random((BB_DOCS, BB_LENGTH))
  for d in range(BB_DOCS):
    x = [int(first_N[d])]
    for i in range(1, BB_LENGTH):
      t = x[-1]
      x.append(
        x[-2] if trigger_V[t] else min(int(cdf_VV[t].searchsorted(u_NL[d, i])), V - 1)
      )
    yield f"{d:05d}", "".join(BB_SYMBOLS[i] for i in x)


def _text(pattern: str, data_cfg) -> Iterator[tuple[str, str]]:
  paths = sorted(p for p in glob.glob(str(Path(pattern).expanduser()), recursive=True))
  files = [Path(p) for p in paths if Path(p).is_file()]
  if not files:
    raise ConfigError(f"data.source: text:{pattern} matches no file")
  found = 0
  for path in files:
    try:
      raw = path.read_bytes()
    except OSError as e:
      raise ConfigError(
        f"data.source: cannot read {path} ({e.strerror or e})"
      ) from None
    if b"\0" in raw[:8192]:
      raise ConfigError(f"data.source: {path} is binary, not text")
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ConfigError(
        f"data.source: {path} is not UTF-8 text (byte {e.start})"
      ) from None
    if path.suffix == ".jsonl":
      for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
          doc = _json_text(line, data_cfg.text_field, f"{path} line {i}")
          if doc.strip():
            found += 1
            yield f"{path}:{i}", doc
    elif text.strip():
      found += 1
      yield str(path), text
  if not found:
    raise ConfigError(
      f"data.source: text:{pattern}: the corpus is empty ({len(files)} files, no text)"
    )


def _json_text(line: str, field: str, where: str) -> str:
  try:
    obj = json.loads(line)
  except json.JSONDecodeError as e:
    raise ConfigError(f"data.source: {where}: not JSON ({e.msg})") from None
  if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
    raise ConfigError(
      f"data.source: {where}: no string field {field!r} (data.text_field)"
    )
  return obj[field]


def _tfds(spec: str, data_cfg) -> Corpus:
  import tensorflow_datasets as tfds

  name, _, config = spec.partition(":")
  root = Path(data_cfg.data_dir).expanduser() / name
  if config:
    root = root / config
  versions = sorted(
    (p for p in root.glob("*") if (p / "dataset_info.json").exists()),
    key=lambda p: tuple(int(x) for x in p.name.split(".") if x.isdigit()),
  )
  if not versions:
    found = root.glob("*/*/dataset_info.json") if not config else ()
    configs = sorted({p.parent.parent.name for p in found})
    if configs:
      raise ConfigError(
        f"data.source: tfds:{spec} has configs; name one: "
        + ", ".join(f"tfds:{name}:{c}" for c in configs)
      )
    raise ConfigError(
      f"data.source: tfds:{spec} is not prepared under {root} (data.data_dir); "
      f"prepare it there with `tfds build {name}"
      f"{'/' + config if config else ''} --data_dir={data_cfg.data_dir} "
      "--file_format=array_record`"
    )
  try:
    builder = tfds.builder_from_directory(str(versions[-1]))
  except Exception as e:  # a damaged or foreign dataset_info.json
    raise ConfigError(
      f"data.source: {versions[-1]} does not read as a TFDS dataset "
      f"({type(e).__name__})"
    ) from None
  field = data_cfg.text_field
  if field not in builder.info.features:
    raise ConfigError(
      f"data.text_field: tfds:{spec} has no feature {field!r} "
      f"(it has {', '.join(builder.info.features)})"
    )
  try:
    sources = builder.as_data_source()
  except Exception as e:  # prepared as tfrecord: no random access without TF
    raise ConfigError(
      f"data.source: tfds:{spec} in {versions[-1]} cannot be read without "
      f"TensorFlow ({type(e).__name__}); rebuild it with --file_format=array_record"
    ) from None
  if "train" not in sources:
    raise ConfigError(f"data.source: tfds:{spec} has no train split")

  def docs(split):
    src = sources[split]
    for i in range(len(src)):
      text = src[i][field]
      text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
      if text.strip():
        yield f"{split}:{i}", text

  held = "validation" if "validation" in sources else None
  return Corpus(f"tfds:{spec}", tuple(docs("train")), tuple(docs(held)) if held else ())
