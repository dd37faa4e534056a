"""Prompts for a pretrained model (`data.source=prompts:FILE`), read by its
tokenizer (`restore.language_model`'s).

FILE is a text file, one prompt per non-empty line, or JSONL, one object per
line with the prompt under `data.text_field` (GSM8K's files: "question").
Each prompt is one row of the analysis batch, tokenized as the model's own
tokenizer does (its post-processor adds <bos> where the model expects it),
cut to `data.seq_len` tokens and right-padded; the padding is masked out of
every statistic and attends only to itself.
"""

import hashlib
import json
from pathlib import Path

import numpy as np

from loopjax import sharding
from loopjax.data import lm
from loopjax.errors import ConfigError


def read(source: str, field: str) -> list[str]:
  """The prompts of `data.source` "prompts:FILE"."""
  path = Path(source.removeprefix("prompts:")).expanduser()
  if not path.is_file():
    raise ConfigError(f"data.source: no prompts file {path}")
  lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
  prompts = lines if path.suffix != ".jsonl" else column(path, lines, field, "text")
  if not prompts:
    raise ConfigError(f"data.source: {path} holds no prompt")
  return prompts


def answers(source: str, field: str) -> list[str]:
  """The gold answers of a JSONL prompts file, under `data.answer_field`."""
  path = Path(source.removeprefix("prompts:")).expanduser()
  if path.suffix != ".jsonl":
    raise ConfigError(
      f"data.answer_field: {path} is not JSONL; answers need one object per line"
    )
  lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
  return [str(a) for a in column(path, lines, field, "answer")]


def column(path: Path, lines: list[str], field: str, what: str) -> list:
  """Each JSONL line's `field`, or one line naming the line and the field."""
  out = []
  for i, ln in enumerate(lines, 1):
    try:
      out.append(json.loads(ln)[field])
    except (json.JSONDecodeError, KeyError, TypeError):
      raise ConfigError(
        f"{path}:{i}: not a JSON object with a field data.{what}_field={field!r}"
      ) from None
  return out


def lm_data(config, tokenizer: str, prompts: list[str]) -> lm.LmData:
  """The prompts as a language-model task: its tokenizer and specials, and
  a fingerprint of tokenizer and prompts (analyses record it)."""
  data = lm.without_streams(config.data, tokenizer)
  sha = hashlib.sha256((tokenizer + "\0" + "\0".join(prompts)).encode())
  return data.__class__(**{**data.__dict__, "fingerprint": sha.hexdigest()})


def batches(task: lm.LmData, prompts: list[str], batch_size: int, feed=None):
  """(batches, n): the n prompts as rows of at most `task.seq_len` tokens,
  right-padded to the longest, in batches of `batch_size` (the last filled by
  repeating rows; results keep the first n). Each batch has the LM analyses'
  fields: inputs, targets and their mask, segments (padding its own), real.
  `feed`: the model's (`sharding.Feed`: each batch split over its devices,
  `batch_size` rounded up to their split), or none."""
  feed = feed or sharding.Feed(None, ())
  ids = [lm.encode(task.tokenizer_json, p)[: task.seq_len + 1] for p in prompts]
  if min(map(len, ids)) < 2:
    raise ConfigError("data.source: a prompt encodes to fewer than 2 tokens")
  T = max(map(len, ids)) - 1
  tokens = np.full((len(ids), T + 1), task.pad_id, np.int32)
  real = np.zeros((len(ids), T + 1), bool)
  for i, row in enumerate(ids):
    tokens[i, : len(row)], real[i, : len(row)] = row, True
  n = len(ids)
  B = feed.size(batch_size, n)
  rows = np.resize(np.arange(n), -(-n // B) * B).reshape(-1, B)
  return [
    feed.put(
      {
        "inputs": tokens[r, :-1],
        "targets": tokens[r, 1:],
        "mask": real[r, 1:].astype(np.float32),
        "segments": (~real[r, :-1]).astype(np.int32),
        "real": real[r, :-1],
      }
    )
    for r in rows
  ], n
