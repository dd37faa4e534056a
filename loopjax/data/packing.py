"""A split's token stream cut into rows of seq_len + 1 tokens: the inputs and,
shifted by one, the targets, each target predicted once per epoch.

At fixed offsets, or with `data.align` each row starting at `<bos>` (a sink
needs a token fixed at position 0 to form on, Gu et al. 2025): a document's
own, or, where a row starts inside a document, a `<bos>` placed in front of
its continuation (StreamingLLM's dedicated start token; it predicts nothing).
"""

import numpy as np


def to_stream(docs, bos: int | None, eos: int) -> dict:
  """Token ids of documents as one stream, `<bos> doc <eos> ...` (no `<bos>`
  when `bos` is None), with each token's document index."""
  pieces, segments = [np.zeros(0, np.int32)], [np.zeros(0, np.int32)]
  for i, ids in enumerate(docs):
    doc = np.concatenate([[] if bos is None else [bos], ids, [eos]]).astype(np.int32)
    pieces.append(doc)
    segments.append(np.full(len(doc), i, np.int32))
  return {"tokens": np.concatenate(pieces), "segments": np.concatenate(segments)}


def rows(stream: dict, seq_len: int, align: bool) -> dict:
  """The rows of seq_len + 1 tokens along a stream, as {"start": (N,) int64,
  "placed": (N,) bool}: a row's first stream token, and whether a `<bos>` is
  placed before it. Each row's last target is the next row's first input.
  Without `align` rows sit at fixed offsets. With it (the stream starts at a
  `<bos>`), a row starting at a document's `<bos>` takes seq_len + 1 stream
  tokens; one starting inside a document takes seq_len behind a placed `<bos>`
  whose prediction, the previous row's last target, gets no loss. So every
  target is predicted once, and no token is lost."""
  n = len(stream["tokens"])
  if not align:
    num = max((n - 1) // seq_len, 0)
    return {"start": np.arange(num) * seq_len, "placed": np.zeros(num, bool)}
  seg = stream["segments"]
  doc_start = np.r_[True, seg[1:] != seg[:-1]]
  start, placed, p = [], [], 0
  while True:
    own = bool(doc_start[p]) if p < n else True
    if p + seq_len + own > n:
      break
    start.append(p)
    placed.append(not own)
    p += seq_len - (not own)
  return {"start": np.asarray(start, np.int64), "placed": np.asarray(placed, bool)}


def windows(stream: dict, rows: dict, idx_B: np.ndarray, seq_len: int, bos_id: int):
  """The batch of rows `idx_B` (`rows`): inputs, targets, their loss mask and
  segment ids."""
  placed_B = rows["placed"][idx_B]
  at_BT = rows["start"][idx_B][:, None] - placed_B[:, None] + np.arange(seq_len + 1)
  tokens, segments = stream["tokens"][at_BT], stream["segments"][at_BT]
  tokens[placed_B, 0] = bos_id
  segments[placed_B, 0] = segments[placed_B, 1]
  mask = segments[:, 1:] == segments[:, :-1]
  mask[placed_B, 0] = False  # the previous row's last target
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "segments": segments[:, :-1],
    "mask": mask.astype(np.float32),
  }
