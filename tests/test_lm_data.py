"""The language-model task's data: corpora, tokenizer, storage, packing, errors."""

import time

import numpy as np
import pytest

from loopjax import config as config_lib
from loopjax.data import corpus, lm, packing, tokenizer
from loopjax.errors import ConfigError


def test_tokenizer_round_trip_and_training_is_deterministic(lm_config):
  docs = corpus.load(lm_config.data).docs
  a, b = (lm.train_tokenizer(docs, 300) for _ in range(2))
  assert a == b
  text = "def total(x):\n    return x + 1  # ünïcode, tabs\t and bytes\n"
  assert lm.decode(a, lm.encode(a, text)) == text  # byte-level: any text
  assert lm.tokenizer_from_json(a).get_vocab_size() == 300


def test_a_line_without_whitespace_trains_in_bounded_pieces(lm_config, capsys):
  """BPE's time grows with the square of a word's length (400 KB: 81 s, 10
  MB: past 600 s): a run longer than LONGEST_WORD is learned from in pieces,
  and a corpus without one trains the tokenizer it did before."""
  docs = corpus.load(lm_config.data).docs
  text = "ab" * 1_000_000  # 2 MB, one pre-token
  pieces = list(tokenizer._bounded("x y " + text + " z", runs := []))
  assert "".join(pieces) == "x y " + text + " z" and runs == [len(text)]
  assert max(map(len, pieces)) <= tokenizer.LONGEST_WORD + 4
  assert list(tokenizer._bounded(docs[0][1], [])) == [docs[0][1]]
  start = time.monotonic()
  tok = lm.train_tokenizer([*docs, ("long", text)], 300)
  assert time.monotonic() - start < 60  # unbounded: hours
  assert "1 run(s) without whitespace (longest 2,000,000" in capsys.readouterr().out
  assert lm.decode(tok, lm.encode(tok, text[:5000])) == text[:5000]


def test_a_vocabulary_the_corpus_cannot_fill_is_said_and_recorded(lm_config, capsys):
  lm_config.data.vocab_size = 50_000_000
  data = lm.read(lm_config.data)
  assert data.vocab_size < 50_000_000
  assert data.summary()["vocab_size"] == data.vocab_size
  assert (
    f"data: the corpus fills {data.vocab_size:,} of the 50,000,000 tokens "
    "data.vocab_size asks for"
  ) in capsys.readouterr().out


def test_dataset_is_stored_once_and_reads_back_the_same(lm_config, tmp_path):
  first = lm.read(lm_config.data)
  stored = list((tmp_path / "data" / "lm_tokens").glob("*/1.0.0"))
  assert len(stored) == 1 and (stored[0] / "tokenizer.json").exists()
  again = lm.read(lm_config.data)
  assert again.fingerprint == first.fingerprint
  for split in first.streams:
    np.testing.assert_array_equal(
      first.streams[split]["tokens"], again.streams[split]["tokens"]
    )
  # The tokens are the documents' encodings, bracketed by <bos> and <eos>.
  docs = lm.held_out(corpus.load(lm_config.data), 0.2, 0)["train"]
  want = [first.bos_id, *lm.encode(first.tokenizer_json, docs[0][1]), first.eos_id]
  np.testing.assert_array_equal(first.streams["train"]["tokens"][: len(want)], want)


def test_a_changed_corpus_is_another_dataset(lm_config, tmp_path):
  before = lm.read(lm_config.data).fingerprint
  (tmp_path / "corpus" / "doc000.py").write_text("x = 1\n" * 50)
  assert lm.read(lm_config.data).fingerprint != before


def test_validation_holds_out_whole_documents(lm_config):
  splits = lm.held_out(corpus.load(lm_config.data), 0.2, 0)
  train, valid = ({k for k, _ in splits[s]} for s in ("train", "validation"))
  assert valid and train and not train & valid
  assert len(train) + len(valid) == 24
  assert (
    lm.held_out(corpus.load(lm_config.data), 0.2, 1)["validation"]
    != splits["validation"]
  )  # the seed picks another held-out set


def test_windows_mask_targets_across_document_boundaries():
  # Two documents: <bos> 5 6 <eos> | <bos> 7 8 9 <eos>
  tokens = np.array([1, 5, 6, 2, 1, 7, 8, 9, 2], np.int32)
  segments = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1], np.int32)
  stream = {"tokens": tokens, "segments": segments}
  b = packing.windows(
    stream, packing.rows(stream, 4, align=False), np.array([0, 1]), 4, 1
  )
  np.testing.assert_array_equal(b["inputs"], [[1, 5, 6, 2], [1, 7, 8, 9]])
  np.testing.assert_array_equal(b["targets"], [[5, 6, 2, 1], [7, 8, 9, 2]])
  # <eos> -> the next document's <bos> is not a prediction; <eos> itself is.
  np.testing.assert_array_equal(b["mask"], [[1, 1, 1, 0], [1, 1, 1, 1]])
  np.testing.assert_array_equal(b["segments"], [[0, 0, 0, 0], [1, 1, 1, 1]])


def test_aligned_rows_start_at_bos_and_lose_no_token():
  """data.align: every row starts at <bos>, a document's own or one placed in
  front of its continuation; every target is predicted exactly once."""
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 30, 40)  # shorter and longer than a row
  docs = [rng.integers(3, 50, n) for n in lengths]
  stream = packing.to_stream(docs, 1, 2)
  T = 8
  table = packing.rows(stream, T, align=True)
  b = packing.windows(stream, table, np.arange(len(table["start"])), T, 1)
  assert (b["inputs"][:, 0] == 1).all()
  assert table["placed"].any() and (~table["placed"]).any()
  # The scored targets, row after row, are the stream's, once each, in order
  # (a document's <bos> is no target; the stream's tail short of a row is left).
  scored = b["targets"][b["mask"] > 0]
  want = stream["tokens"][1:][stream["segments"][1:] == stream["segments"][:-1]]
  np.testing.assert_array_equal(scored, want[: len(scored)])
  assert len(want) - len(scored) < T
  # A placed <bos> belongs to the document it continues and predicts nothing.
  placed = b["segments"][table["placed"]]
  assert (placed[:, 0] == placed[:, 1]).all()
  assert (b["mask"][table["placed"], 0] == 0).all()
  # Without align: rows at fixed offsets, every T tokens.
  plain = packing.rows(stream, T, align=False)
  np.testing.assert_array_equal(plain["start"], np.arange(len(plain["start"])) * T)


def test_jsonl_documents_and_their_errors(lm_config, tmp_path):
  p = tmp_path / "c.jsonl"
  p.write_text('{"text": "first doc"}\n\n{"text": "second"}\n')
  lm_config.data.source = f"text:{p}"
  assert [t for _, t in corpus.load(lm_config.data).docs] == ["first doc", "second"]
  p.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
  with pytest.raises(ConfigError, match=r"c.jsonl line 2: no string field 'text'"):
    corpus.load(lm_config.data)


def test_stdlib_corpus_is_the_running_pythons_sources(lm_config):
  lm_config.data.source = "stdlib"
  docs = corpus.load(lm_config.data).docs
  keys = {k for k, _ in docs}
  assert "json/decoder.py" in keys and len(docs) > 300
  assert not any(k.startswith(("test/", "site-packages/")) for k in keys)


@pytest.mark.parametrize(
  "setup, message",
  [
    (lambda c, d: c.data.update(source=f"text:{d}/nothing/*.txt"), "matches no file"),
    (
      lambda c, d: (
        (d / "e.txt").write_text("  \n") and c.data.update(source=f"text:{d}/e.txt")
      ),
      "the corpus is empty",
    ),
    (
      lambda c, d: (
        (d / "b.bin").write_bytes(b"\x00\x01\x02")
        and c.data.update(source=f"text:{d}/b.bin")
      ),
      "b.bin is binary, not text",
    ),
    (
      lambda c, d: (
        (d / "l.txt").write_bytes("caf\xe9".encode("latin-1"))
        and c.data.update(source=f"text:{d}/l.txt")
      ),
      "l.txt is not UTF-8 text",
    ),
    (
      lambda c, d: (
        (d / "t.json").write_text("{not json")
        and c.data.update(tokenizer=str(d / "t.json"))
      ),
      "t.json does not load as a tokenizer.json",
    ),
    (lambda c, d: c.data.update(seq_len=100_000), "data.seq_len: the train split of"),
    (
      lambda c, d: c.data.update(source="tfds:no_such_dataset"),
      "is not prepared under",
    ),
  ],
)
def test_bad_inputs_name_the_field_or_file(lm_config, tmp_path, setup, message):
  setup(lm_config, tmp_path)
  with pytest.raises(ConfigError, match=message):
    lm.read(lm_config.data)


def test_a_tokenizer_of_another_size_is_refused(lm_config, tmp_path):
  tok = lm.train_tokenizer(corpus.load(lm_config.data).docs, 320)
  (tmp_path / "tok.json").write_text(tok)
  lm_config.data.update(tokenizer=str(tmp_path / "tok.json"))
  with pytest.raises(ConfigError, match="has 320 tokens but data.vocab_size is 300"):
    lm.read(lm_config.data)
  lm_config.data.vocab_size = 320  # a given tokenizer is used as it is
  data = lm.read(lm_config.data)
  assert data.vocab_size == 320 and data.tokenizer_json == tok
  lm_config.data.vocab_size = 384  # an embedding padded to a multiple of 128
  assert lm.read(lm_config.data).vocab_size == 384
  lm_config.data.vocab_size = 385
  with pytest.raises(ConfigError, match=r"or up to 384: an embedding padded"):
    lm.read(lm_config.data)


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("data.source", "generate", "must be 'stdlib', 'bigram_backcopy', 'text:GLOB'"),
    ("data.bos", False, None),  # with data.align: rows start at <bos>
    ("data.vocab_size", 100, "must be >= 259"),
    ("data.seq_len", 1, "must be >= 2"),
    ("data.valid_fraction", 1.0, "must be in \\(0, 1\\)"),
    ("train.supervise", "from_hops", "must be 'last'"),
    ("train.z_loss", -1.0, "must be in \\[0, 1\\)"),
    ("model.num_kv_heads", 3, "must divide model.num_heads \\(2\\)"),
    ("model.mlp_type", "relu", "must be one of gelu, swiglu"),
    ("model.rope_pairing", "odd", "must be one of half, interleaved"),
    ("model.norm_eps", 0.0, "must be in \\(0, 1\\)"),
    ("model.random_positions", 64, "must be 0 for data.task 'lm'"),
  ],
)
def test_lm_config_errors(lm_config, field, value, message):
  section, name = field.split(".")
  lm_config[section][name] = value
  if message is None:
    lm_config.data.align, field, message = True, "data.align", "rows start at <bos>"
  with pytest.raises(ConfigError, match=f"{field}: {message}"):
    config_lib.validate(lm_config)


def test_a_tfds_text_dataset_reads_from_its_directory(lm_config, tmp_path):
  """A prepared TFDS text dataset (array_record), read without its builder."""
  import tensorflow_datasets as tfds

  class TinyText(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
      )

    def _split_generators(self, dl_manager):
      return {
        "train": self._generate_examples(20),
        "validation": self._generate_examples(3),
      }

    def _generate_examples(self, n):
      for i in range(n):
        yield i, {"text": f"line {i} of the tiny text dataset\n" * 20}

  TinyText(data_dir=tmp_path / "data").download_and_prepare(file_format="array_record")
  lm_config.data.source = "tfds:tiny_text"
  c = corpus.load(lm_config.data)
  assert len(c.docs) == 20 and len(c.validation) == 3  # its own validation split
  data = lm.read(lm_config.data)
  assert data.num_windows("validation") >= 1
  lm_config.data.text_field = "body"
  with pytest.raises(
    ConfigError, match="data.text_field: tfds:tiny_text has no feature"
  ):
    corpus.load(lm_config.data)


def test_a_tfds_dataset_with_configs_asks_for_one(lm_config, tmp_path):
  for cfg in ("a", "b"):
    d = tmp_path / "data" / "wiki" / cfg / "1.0.0"
    d.mkdir(parents=True)
    (d / "dataset_info.json").write_text("{}")
  lm_config.data.source = "tfds:wiki"
  with pytest.raises(
    ConfigError, match="has configs; name one: tfds:wiki:a, tfds:wiki:b"
  ):
    corpus.load(lm_config.data)
  lm_config.data.source = "tfds:wiki:a"
  with pytest.raises(ConfigError, match="does not read as a TFDS dataset"):
    corpus.load(lm_config.data)


@pytest.mark.parametrize("docs", [["def f(x): return x\n"], ["def f(x):\n", "x = 1\n"]])
def test_a_corpus_too_small_is_refused_before_any_tokenizer_or_tfds_work(
  lm_config, tmp_path, capfd, docs
):
  """One document (none to hold out), or splits shorter than one sequence even
  at a token per byte: one line, before a BPE is trained or TFDS prepares
  (nothing printed, nothing written under data_dir)."""
  root = tmp_path / "small"
  root.mkdir()
  for i, text in enumerate(docs):
    (root / f"d{i}.py").write_text(text)
  lm_config.data.source = f"text:{root}/*.py"
  capfd.readouterr()
  with pytest.raises(ConfigError, match="data.source|data.seq_len"):
    lm.read(lm_config.data)
  out, err = capfd.readouterr()
  assert out == err == "", (out, err)
  assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())
