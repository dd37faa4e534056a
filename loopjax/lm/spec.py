"""What config validation reads of the language-model family: its config rules
(trained, retrofitted from a pretrained model, or a pretrained model's
analysis) and its analyses by name: `LM`, the `task.Spec` that
`task.FAMILIES` names. JAX-free, as kg/spec.py.
"""

from pathlib import Path

from loopjax.analysis.registry import Entry, shared
from loopjax.errors import ConfigError
from loopjax.task import Spec

MIN_VOCAB = 259  # a trained byte-level tokenizer: 256 bytes, <pad>, <bos>, <eos>
# The BPE trainer (tokenizers) allocates ~66 bytes per vocabulary entry up
# front: at 2^31 it asked for 141,733,920,784 bytes and aborted the process.
# 2^20 is 69 MB, four times Gemma's 262,144 (the largest vocabulary in use).
MAX_VOCAB = 2**20


def check(c) -> None:
  """The `data` and `train` fields a language model reads (config.validate)."""
  d = c.data
  if not (
    d.source in ("stdlib", "bigram_backcopy") or d.source.startswith(("text:", "tfds:"))
  ):
    raise ConfigError(
      "data.source: must be 'stdlib', 'bigram_backcopy', 'text:GLOB' or "
      f"'tfds:NAME[:CONFIG]' for data.task 'lm'; got {d.source!r}"
    )
  if d.align and not d.bos:
    raise ConfigError("data.align: rows start at <bos>, so it needs data.bos=True")
  if not d.tokenizer and d.vocab_size < MIN_VOCAB:  # a given one: its own size
    raise ConfigError(
      f"data.vocab_size: must be >= {MIN_VOCAB} (every byte and <pad> <bos> <eos>); "
      f"got {d.vocab_size}"
    )
  if not d.tokenizer and d.vocab_size > MAX_VOCAB:
    raise ConfigError(
      f"data.vocab_size: must be <= {MAX_VOCAB:,} for a tokenizer trained here "
      f"(lm/spec.MAX_VOCAB); got {d.vocab_size}"
    )
  if d.seq_len < 2:
    raise ConfigError(f"data.seq_len: must be >= 2; got {d.seq_len}")
  if not 0 < d.valid_fraction < 1 or d.valid_sequences < 0:
    raise ConfigError(
      "data.valid_fraction: must be in (0, 1) and data.valid_sequences >= 0; got "
      f"{d.valid_fraction!r}, {d.valid_sequences!r}"
    )
  if c.train.supervise != "last" or c.train.label_smoothing:
    raise ConfigError(
      "train.supervise: must be 'last' with no train.label_smoothing for "
      f"data.task 'lm'; got {c.train.supervise!r}, {c.train.label_smoothing!r}"
    )
  if c.model.random_positions:
    raise ConfigError(
      "model.random_positions: must be 0 for data.task 'lm' (decoding counts "
      f"positions from its cache); got {c.model.random_positions}"
    )
  if not (0 <= c.train.z_loss < 1):
    raise ConfigError(f"train.z_loss: must be in [0, 1); got {c.train.z_loss!r}")
  if c.train.xent != "softmax":
    raise ConfigError(
      "train.xent: must be 'softmax' for data.task 'lm' (StableMax is the "
      f"answer loss of the knowledge-graph tasks); got {c.train.xent!r}"
    )


def pretrained(c) -> None:
  """The fields a pretrained model's run reads (`loopjax.lm.pretrained`)."""
  d, m = c.data, c.model
  if not m.hf_dir:
    raise ConfigError(
      "model.hf_dir: a local Hugging Face model directory is required with "
      f"data.source {d.source!r}"
    )
  if d.task != "lm" or not d.source.startswith("prompts:"):
    raise ConfigError(
      "data.source: must be 'prompts:FILE' (data.task 'lm') for a pretrained "
      f"model (model.hf_dir); got task {d.task!r}, source {d.source!r}"
    )
  if d.seq_len < 2:
    raise ConfigError(f"data.seq_len: must be >= 2; got {d.seq_len}")


def _hf_path(init_from: str) -> Path:
  """DIR of `model.init_from` "hf:DIR"."""
  return Path(init_from.removeprefix("hf:")).expanduser()


def init_from(c) -> None:
  """The fields a run started from a pretrained model reads
  (`loopjax.pretrained.init_from`); its tensors, layer split and tokenizer
  size are checked where they are read, still before anything compiles."""
  d, m = c.data, c.model
  if not m.init_from.startswith("hf:"):
    raise ConfigError(
      "model.init_from: must be '' or 'hf:DIR' (a local Hugging Face model "
      f"directory); got {m.init_from!r}"
    )
  path = _hf_path(m.init_from)
  for name in ("config.json", "tokenizer.json"):
    if not (path / name).is_file():
      raise ConfigError(f"model.init_from: {path} has no {name}")
  if m.hf_dir or d.task != "lm":
    raise ConfigError(
      "model.init_from: trains a language model (data.task 'lm', no "
      f"model.hf_dir); got task {d.task!r}, hf_dir {m.hf_dir!r}"
    )
  if not m.hf_split:
    raise ConfigError(
      "model.hf_split: required with model.init_from: prelude,core,coda layer "
      "counts that add up to the model's layers, e.g. 1,1,1 for 3"
    )
  if d.tokenizer and Path(d.tokenizer).expanduser() != path / "tokenizer.json":
    raise ConfigError(
      f"data.tokenizer: must be '' or {path / 'tokenizer.json'} with "
      f"model.init_from (the model's own, set from it); got {d.tokenizer!r}"
    )


# Analyses (lm/analyze.py): one streamed pass over validation windows
# (depth_scan) that the shared ones read, and each exit rule's iterations per
# token (lm_halting); records in lm/analyses.py.
ANALYSES = {
  "fixed_points": Entry("loopjax.lm.analyses:FIXED_POINTS", shared=True),
  "stages": Entry("loopjax.lm.analyses:STAGES", shared=True),
  "attention": Entry("loopjax.lm.analyses:ATTENTION", shared=True),
  "halting": Entry("loopjax.lm.analyses:HALTING", shared=False),
}
SHARED = shared(ANALYSES)
LM = Spec(
  check,
  ANALYSES,
  SHARED,
  pretrained=pretrained,
  init_from=init_from,
  report="loopjax.lm.report:PARTS",
)
