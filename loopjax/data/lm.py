"""The language-model task's data: a corpus tokenized once, stored, and packed.

A byte-level BPE tokenizer is trained on the corpus at `data.vocab_size` (or
`data.tokenizer` names a tokenizer.json), cached under data_dir by the
corpus's fingerprint. The tokenized documents are a TFDS dataset (array_record)
named by the corpus's and the tokenizer's fingerprints, with the tokenizer
beside it, prepared once and shared by every run and host. Documents are held
out for validation by a hash of their key (or the source's own validation
split), so no text of a held-out document is ever trained on.

Each split is read into one stream: `<bos> doc <eos> <bos> doc <eos> ...`
(`data.bos`), with the document index of every token. A sequence is a row
of `data.seq_len + 1` tokens: the inputs and, shifted by one, the targets;
attention stays inside a document (segment ids) and a target that starts
another document gets no loss. Rows follow each other along the stream
(`packing`: at fixed offsets, or with `data.align` each starting at `<bos>`).
"""

import dataclasses
import fcntl
import functools
import hashlib
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds

from loopjax.data import corpus as corpus_lib
from loopjax.data import packing, pipeline, tfds_store
from loopjax.data.tokenizer import (  # noqa: F401 (lm.X: the task's API)
  SPECIALS,
  decode,
  embeds,
  encode,
  given,
  padded,
  special_ids,
  tokenizer_from_json,
  train_tokenizer,
)
from loopjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LmData:
  """Token streams of the train and validation splits, and their tokenizer."""

  tokenizer_json: str
  vocab_size: int
  pad_id: int
  bos_id: int
  eos_id: int
  seq_len: int
  streams: dict  # split -> {"tokens": (N,), "segments": (N,)} int32
  fingerprint: str
  task: str = "lm"
  align: bool = False

  def model_dims(self) -> tuple[int, int]:
    """(vocab size, longest sequence) the model is built for."""
    return self.vocab_size, self.seq_len

  @functools.cached_property
  def rows(self) -> dict:
    """split -> `packing.rows` of its stream."""
    return {
      k: packing.rows(v, self.seq_len, self.align) for k, v in self.streams.items()
    }

  def num_windows(self, split: str) -> int:
    return len(self.rows[split]["start"])

  def windows(self, split: str, idx_B: np.ndarray) -> dict:
    """The batch of rows `idx_B` of a split (`packing.windows`)."""
    stream, rows = self.streams[split], self.rows[split]
    return packing.windows(stream, rows, idx_B, self.seq_len, self.bos_id)

  def summary(self) -> dict:
    """What a workdir's dataset.json records: fingerprint, sizes, vocab size."""
    return {
      "fingerprint": self.fingerprint,
      "sizes": {k: len(v["tokens"]) for k, v in self.streams.items()},
      "vocab_size": self.vocab_size,
    }


# --- the tokenizer -------------------------------------------------------------


def _sha(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()


# --- storage -------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _TokensConfig(tfds.core.BuilderConfig):
  corpus: object = None
  tokenizer_json: str = ""
  valid_fraction: float = 0.0
  seed: int = 0


class LmTokens(tfds.core.GeneratorBasedBuilder):
  """A corpus's documents as token ids (no specials), in key order."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      features=tfds.features.FeaturesDict(
        {
          "ids": tfds.features.Tensor(shape=(None,), dtype=np.int32),
          "index": tfds.features.Scalar(dtype=np.int64),
        }
      ),
      metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    c = self.builder_config
    splits = held_out(c.corpus, c.valid_fraction, c.seed)
    tok = tokenizer_from_json(c.tokenizer_json)
    ids = {
      k: [e.ids for e in tok.encode_batch([t for _, t in v])] for k, v in splits.items()
    }
    self.info.metadata["fingerprint"] = _stored_fingerprint(ids)
    self.info.metadata["documents"] = {k: len(v) for k, v in ids.items()}
    return {k: self._generate_examples(v) for k, v in ids.items()}

  def _generate_examples(self, docs):
    for i, ids in enumerate(docs):
      yield i, {"ids": np.asarray(ids, np.int32), "index": i}


def held_out(corpus, valid_fraction: float, seed: int) -> dict:
  """{"train": docs, "validation": docs}: the source's own validation split, or
  the documents whose key hashes (with the seed) below `valid_fraction`."""
  if corpus.validation:
    return {"train": list(corpus.docs), "validation": list(corpus.validation)}
  if len(corpus.docs) < 2:
    raise ConfigError(
      f"data.source: {corpus.source} has {len(corpus.docs)} document; a validation "
      "split holds out whole documents, so it needs at least 2"
    )

  def u(key):  # a uniform draw in [0, 1) per document, fixed by key and seed
    return int(hashlib.sha256(f"{seed}|{key}".encode()).hexdigest()[:12], 16) / 16**12

  draws = np.array([u(k) for k, _ in corpus.docs])
  valid = draws < valid_fraction
  if not valid.any():  # at least one, at most all but one
    valid[np.argmin(draws)] = True
  if valid.all():
    valid[np.argmax(draws)] = False
  return {
    "train": [d for d, v in zip(corpus.docs, valid, strict=True) if not v],
    "validation": [d for d, v in zip(corpus.docs, valid, strict=True) if v],
  }


def _stored_fingerprint(ids: dict) -> str:
  h = hashlib.sha256()
  for split in sorted(ids):
    for doc in ids[split]:
      a = np.asarray(doc, "<i4")
      h.update(f"|{split}:{a.size}|".encode())
      h.update(a.tobytes())
  return h.hexdigest()


def _locked(root: Path, name: str):
  root.mkdir(parents=True, exist_ok=True)
  lock = open(root / f"{name}.lock", "w")  # noqa: SIM115 (closed by the caller)
  fcntl.flock(lock, fcntl.LOCK_EX)
  return lock


def tokenizer(data_cfg, corpus) -> str:
  """The tokenizer.json text: data.tokenizer, or trained once per corpus."""
  if data_cfg.tokenizer:
    return given(data_cfg.tokenizer, data_cfg.vocab_size)
  root = Path(data_cfg.data_dir).expanduser() / "lm_tokenizers"
  name = f"bpe_{corpus.fingerprint[:16]}_v{data_cfg.vocab_size}"
  path = root / f"{name}.json"
  with _locked(root, name):
    if not path.exists():
      print(f"data: training a {data_cfg.vocab_size}-token BPE on {corpus.source}")
      tmp = path.with_suffix(".tmp")
      tmp.write_text(train_tokenizer(corpus.docs, data_cfg.vocab_size))
      tmp.replace(path)
    return path.read_text()


def read(data_cfg) -> LmData:
  """The corpus tokenized (preparing it once), as streams, fingerprint-checked."""
  corpus = corpus_lib.load(data_cfg)
  _fits(corpus, data_cfg)  # before a tokenizer is trained or TFDS prepares
  tok_json = tokenizer(data_cfg, corpus)
  pad, bos, eos = special_ids(tok_json, data_cfg.tokenizer or "the trained tokenizer")
  name = (
    f"c{corpus.fingerprint[:16]}_t{_sha(tok_json)[:16]}"
    f"_f{data_cfg.valid_fraction!r}_s{data_cfg.seed}"
  )
  root = Path(data_cfg.data_dir).expanduser()
  config = _TokensConfig(
    name=name,
    corpus=corpus,
    tokenizer_json=tok_json,
    valid_fraction=float(data_cfg.valid_fraction),
    seed=int(data_cfg.seed),
  )
  builder = tfds_store.prepare_once(
    root, f"lm_tokens_{name}", lambda: LmTokens(config=config, data_dir=root)
  )
  if not (beside := Path(builder.data_dir) / "tokenizer.json").exists():
    beside.write_text(tok_json)  # the tokenizer the tokens were made with
  sources = builder.as_data_source()
  docs = {}
  for split in ("train", "validation"):
    src = sources[split]
    records = src.__getitems__(range(len(src)))
    docs[split] = [r["ids"] for r in sorted(records, key=lambda r: r["index"])]
  stored = builder.info.metadata["fingerprint"]
  if _stored_fingerprint(docs) != stored:
    raise ConfigError(
      f"{builder.data_dir}: the tokens on disk do not match their fingerprint; "
      "the data is corrupt, delete that directory"
    )
  streams = {
    k: packing.to_stream(v, bos if data_cfg.bos else None, eos) for k, v in docs.items()
  }
  data = LmData(
    tokenizer_json=tok_json,
    vocab_size=_rows(data_cfg, tok_json),
    pad_id=pad,
    bos_id=bos,
    eos_id=eos,
    seq_len=int(data_cfg.seq_len),
    streams=streams,
    fingerprint=_sha(
      f"{stored}|{_sha(tok_json)}|bos={bool(data_cfg.bos)}"
      + ("|align" if data_cfg.align else "")  # unaligned runs keep theirs
    ),
    align=bool(data_cfg.align),
  )
  if data.vocab_size < data_cfg.vocab_size:  # BPE ran out of pairs to merge
    print(
      f"data: the corpus fills {data.vocab_size:,} of the {data_cfg.vocab_size:,} "
      f"tokens data.vocab_size asks for; the model has {data.vocab_size:,} "
      "(dataset.json records it)"
    )
  for split in streams:
    if data.num_windows(split) < 1:
      raise ConfigError(
        f"data.seq_len: the {split} split has {len(streams[split]['tokens'])} tokens, "
        f"fewer than one sequence of {data.seq_len} + 1; use a shorter data.seq_len "
        "or a larger corpus"
      )
  return data


def _fits(corpus, data_cfg) -> None:
  """The checks a corpus fails before it is tokenized: too few documents to
  hold one out, or a split whose every byte as a token (more than any
  tokenizer makes, specials included) is less than one sequence. The exact
  count, after tokenizing, is `read`'s."""
  n = int(data_cfg.seq_len) + 1
  for split, docs in held_out(corpus, data_cfg.valid_fraction, data_cfg.seed).items():
    most = sum(len(text.encode()) + 8 for _, text in docs)
    if most < n:
      raise ConfigError(
        f"data.seq_len: the {split} split of {corpus.source} has {len(docs)} "
        f"document(s), at most {most} tokens, fewer than one sequence of "
        f"{n - 1} + 1; use a shorter data.seq_len or a larger corpus"
      )


def _rows(data_cfg, tokenizer_json: str) -> int:
  """The embedding's rows: a given tokenizer's data.vocab_size (which may pad
  it, `padded`), else the tokenizer's size."""
  if data_cfg.tokenizer:
    return int(data_cfg.vocab_size)
  return tokenizer_from_json(tokenizer_json).get_vocab_size()


def without_streams(data_cfg, tokenizer_json: str | None = None) -> LmData:
  """The task's shape (vocabulary, specials, sequence length) without its
  corpus: what building a model to restore or sample needs. Without a
  tokenizer (ahead-of-time compiles, from the config alone): data.vocab_size
  rows, no specials."""
  if tokenizer_json is None:
    pad = bos = eos = 0
    rows = int(data_cfg.vocab_size)
  else:
    pad, bos, eos = special_ids(tokenizer_json, "tokenizer.json")
    rows = _rows(data_cfg, tokenizer_json)
  return LmData(
    tokenizer_json=tokenizer_json or "",
    vocab_size=rows,
    pad_id=pad,
    bos_id=bos,
    eos_id=eos,
    seq_len=int(data_cfg.seq_len),
    streams={},
    fingerprint="",
  )


def train_iterator(data: LmData, batch_size: int, seed: int, shard=(0, 1)):
  """Endless shuffled batches of training windows (pipeline.shuffled_batches)."""
  return pipeline.shuffled_batches(
    np.arange(data.num_windows("train")),
    batch_size,
    seed,
    lambda idx_B: data.windows("train", idx_B),
    shard,
  )
