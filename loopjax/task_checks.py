"""Config checks of the fields one task family reads (called by config.validate).

Kept apart from the families' packages so that validating a config imports no
JAX and no data library: a bad value fails in a fraction of a second.
`task.FAMILIES` names each family's checker.
"""

from pathlib import Path

from loopjax.errors import ConfigError

MIN_VOCAB = 259  # a trained byte-level tokenizer: 256 bytes, <pad>, <bos>, <eos>
# The BPE trainer (tokenizers) allocates ~66 bytes per vocabulary entry up
# front: at 2^31 it asked for 141,733,920,784 bytes and aborted the process.
# 2^20 is 69 MB, four times Gemma's 262,144 (the largest vocabulary in use).
MAX_VOCAB = 2**20
# Numbers a knowledge-graph generator holds at once (int64 and float64: 8
# bytes each, 2 GiB): composition enumerates every 2-hop chain (E * D^2 of
# them, and E * R draws; the grokked transformer's largest, 2000 * 20^2 =
# 800,000), chains pads each example of k = 2 .. max_hops hops to max_hops +
# 1 tokens. Past it, numpy's MemoryError (2^31 entities asked for 128 GiB).
MAX_GENERATED = 2**28


def _kg_source(c) -> None:
  if not (c.data.source == "generate" or c.data.source.startswith("grokked_json:")):
    raise ConfigError(
      f"data.source: must be 'generate' or 'grokked_json:DIR'; got {c.data.source!r}"
    )


def _no_curriculum(c) -> None:
  if c.train.curriculum.enabled:
    raise ConfigError(
      "train.curriculum.enabled: needs data.task 'chains' (a hop curriculum); "
      f"got task {c.data.task!r}"
    )


def _generated(c, fields: str, what: str, n: int) -> None:
  """Refuses a generated task of more than MAX_GENERATED numbers, before the
  generator tries (a MemoryError, or minutes of it)."""
  if c.data.source == "generate" and n > MAX_GENERATED:
    raise ConfigError(
      f"{fields}: the generator would hold {n:.3g} {what}, more than "
      f"{MAX_GENERATED:,} (task_checks.MAX_GENERATED)"
    )


def composition(c) -> None:
  """The fields a 2-hop composition run reads (config.validate)."""
  _kg_source(c)
  _no_curriculum(c)
  d = c.data
  if d.pad_to:
    raise ConfigError(
      f"data.pad_to: k-hop chains only (data.task 'chains'); got {d.pad_to}"
    )
  if d.out_degree > d.num_relations:
    raise ConfigError(
      f"data.out_degree: must be <= data.num_relations "
      f"({d.num_relations}); got {d.out_degree}"
    )
  numbers = d.num_entities * max(d.out_degree**2, d.num_relations)
  fields = "data.num_entities, data.out_degree"
  _generated(c, fields, "numbers (E * D^2 chains)", numbers)


def chains(c) -> None:
  """The fields a k-hop chains run reads (config.validate)."""
  _kg_source(c)
  d, cur = c.data, c.train.curriculum
  if d.max_hops < 2:
    raise ConfigError(f"data.max_hops: must be >= 2; got {d.max_hops}")
  if not 2 <= d.train_hops <= d.max_hops:
    raise ConfigError(
      f"data.train_hops: must be in [2, data.max_hops={d.max_hops}]; got {d.train_hops}"
    )
  rows = (d.max_hops - 1) * (d.train_per_hop + d.test_per_hop)
  fields = "data.max_hops, data.train_per_hop, data.test_per_hop"
  _generated(c, fields, "padded tokens", rows * (d.max_hops + 1))
  if d.pad_to and d.pad_to < d.max_hops + 2:
    raise ConfigError(
      f"data.pad_to: 0 (the answer at the chain's last token) or >= "
      f"data.max_hops + 2 = {d.max_hops + 2} (a pad column after every chain); "
      f"got {d.pad_to}"
    )
  if d.train_per_hop < 1 or d.test_per_hop < 0:
    field = "train_per_hop" if d.train_per_hop < 1 else "test_per_hop"
    raise ConfigError(
      f"data.{field}: must be >= {1 if field == 'train_per_hop' else 0}; "
      f"got {d[field]!r}"
    )
  if not cur.enabled:
    return
  if not 2 <= cur.start <= d.train_hops:
    raise ConfigError(
      f"train.curriculum.start: must be in [2, data.train_hops={d.train_hops}]; "
      f"got {cur.start}"
    )
  if not 0 <= cur.threshold <= 1:
    raise ConfigError(
      f"train.curriculum.threshold: must be in [0, 1]; got {cur.threshold!r}"
    )
  if not 0 < cur.lr_decay <= 1:
    raise ConfigError(
      f"train.curriculum.lr_decay: must be in (0, 1]; got {cur.lr_decay!r}"
    )
  if not 0 <= cur.lr_min <= c.train.lr:
    raise ConfigError(
      f"train.curriculum.lr_min: must be in [0, train.lr={c.train.lr}]; got "
      f"{cur.lr_min!r}"
    )
  if d.test_per_hop < 1:
    raise ConfigError(
      "data.test_per_hop: must be >= 1 with a curriculum (it advances on "
      "held-out accuracy); got 0"
    )
  if c.eval_every < 1:
    raise ConfigError(
      "eval_every: must be >= 1 with a curriculum (it advances at evaluations); got 0"
    )


def lm(c) -> None:
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
      f"(task_checks.MAX_VOCAB); got {d.vocab_size}"
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
  if not (0 <= c.train.z_loss < 1):
    raise ConfigError(f"train.z_loss: must be in [0, 1); got {c.train.z_loss!r}")
  if c.train.xent != "softmax":
    raise ConfigError(
      "train.xent: must be 'softmax' for data.task 'lm' (StableMax is the "
      f"answer loss of the knowledge-graph tasks); got {c.train.xent!r}"
    )
  _no_curriculum(c)


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
  _no_curriculum(c)


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
