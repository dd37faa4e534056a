"""A language model's tokenizer: a byte-level BPE trained on a corpus, or a
given tokenizer.json; its special tokens, and the embedding rows it needs.
Its own module: generation, scoring and pretrained loading read text with it
without the corpus storage of `data.lm`."""

import re
from pathlib import Path

from loopjax.errors import ConfigError

SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2 of a trained tokenizer
# Names other tokenizers give the same tokens, first match wins.
_BOS = ("<bos>", "<s>", "<|begin_of_text|>", "<|begin_text|>", "<|endoftext|>")
_EOS = ("<eos>", "</s>", "<|end_of_text|>", "<|end_text|>", "<|endoftext|>")
_PAD = ("<pad>", "<|pad|>", "[PAD]")


def tokenizer_from_json(text: str):
  from tokenizers import Tokenizer

  return Tokenizer.from_str(text)


def train_tokenizer(docs, vocab_size: int) -> str:
  """A byte-level BPE (every byte a token: any text encodes) as tokenizer.json."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(SPECIALS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  split = []
  tok.train_from_iterator(
    (piece for _, text in docs for piece in _bounded(text, split)), trainer=trainer
  )
  if split:
    print(
      f"tokenizer: {len(split)} run(s) without whitespace (longest "
      f"{max(split):,} characters) learned from in {LONGEST_WORD:,}-character pieces"
    )
  return tok.to_str()


# BPE's training time grows with the square of a pre-token's length (a 10 MB
# line without whitespace: past 600 s); no word of a text is this long.
LONGEST_WORD = 1000


def _bounded(text: str, split: list):
  """`text` for the BPE trainer, a run of non-whitespace longer than
  LONGEST_WORD cut into pieces of that length (the rest of the text as it is);
  each such run's length is appended to `split`."""
  start = 0
  for run in re.finditer(rf"\S{{{LONGEST_WORD + 1},}}", text):
    split.append(run.end() - run.start())
    cuts = range(run.start() + LONGEST_WORD, run.end(), LONGEST_WORD)
    for cut in cuts:
      yield text[start:cut]
      start = cut
  yield text[start:]


def given(path: str, vocab_size: int) -> str:
  p = Path(path).expanduser()
  try:
    text = p.read_text()
    tok = tokenizer_from_json(text)
  except Exception as e:  # missing, unreadable, or not a tokenizer.json
    raise ConfigError(
      f"data.tokenizer: {p} does not load as a tokenizer.json ({type(e).__name__})"
    ) from None
  n = tok.get_vocab_size()
  if not embeds(n, vocab_size):
    raise ConfigError(
      f"data.tokenizer: {p} has {n} tokens but data.vocab_size is {vocab_size}; "
      f"set data.vocab_size={n} (or up to {padded(n)}: an embedding padded to a "
      f"multiple of {PAD_MULTIPLE})"
    )
  return text


PAD_MULTIPLE = 128  # embeddings padded past their tokenizer (OLMo 2: 100278 -> 100352)


def padded(n: int) -> int:
  """n tokens' embedding rows rounded up to a multiple of PAD_MULTIPLE."""
  return -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


def embeds(n: int, rows: int) -> bool:
  """Whether an embedding of `rows` is one for a tokenizer of n tokens: as
  many rows, or padded up to a multiple of PAD_MULTIPLE (a larger gap is a
  tokenizer from another model). Training checks this; running a pretrained
  model needs only rows >= n (`lm.prompts`)."""
  return n <= rows <= padded(n)


def special_ids(tokenizer_json: str, where: str) -> tuple[int, int, int]:
  """(pad, bos, eos) ids; pad falls back to eos (padding is masked anyway)."""
  tok = tokenizer_from_json(tokenizer_json)

  def find(names):
    return next((i for n in names if (i := tok.token_to_id(n)) is not None), None)

  bos, eos, pad = find(_BOS), find(_EOS), find(_PAD)
  if eos is None or bos is None:
    raise ConfigError(
      f"data.tokenizer: {where} has no {'end' if eos is None else 'beginning'}"
      f"-of-document token (one of {', '.join(_EOS if eos is None else _BOS)})"
    )
  return (eos if pad is None else pad), bos, eos


def encode(tokenizer_json: str, text: str) -> list[int]:
  return tokenizer_from_json(tokenizer_json).encode(text).ids


def decode(tokenizer_json: str, ids) -> str:
  return tokenizer_from_json(tokenizer_json).decode(list(map(int, ids)))
