"""The sink analyses' positive control (experiments/lm.py:control): on
Guo et al.'s Bigram-Backcopy, where a head has nothing to read at most
tokens, a model parks its attention on <bos>; the analyses must say so."""

import json

import numpy as np
import pytest

from experiments import lm as lm_experiment
from loopjax import analyze, train
from loopjax.data import corpus
from loopjax.lm import study as lm_study


def test_bigram_backcopy_copies_after_triggers_and_follows_bigrams_elsewhere():
  docs = [text for _, text in corpus.bigram_backcopy(0)]
  again = [text for _, text in corpus.bigram_backcopy(0)]
  assert docs == again and len(docs) == corpus.BB_DOCS
  assert {len(d) for d in docs} == {corpus.BB_LENGTH}
  idx_NL = np.array([[corpus.BB_SYMBOLS.index(c) for c in d] for d in docs[:200]])
  # Exactly the symbols whose successor always repeats the symbol before them.
  copied = {
    v
    for v in range(len(corpus.BB_SYMBOLS))
    if (at := np.argwhere(idx_NL[:, 1:-1] == v)).size
    and (idx_NL[at[:, 0], at[:, 1] + 2] == idx_NL[at[:, 0], at[:, 1]]).all()
  }
  assert len(copied) == corpus.BB_TRIGGERS


@pytest.mark.slow  # ~21 s: trains the control, then analyzes it
def test_the_positive_control_forms_a_sink_that_the_analysis_finds(tmp_path):
  """A 1-layer model on aligned rows, 300 steps: its head puts nearly all of
  its attention on <bos> (sink rate 1, ColSum concentration far above uniform
  causal attention's), as Guo et al. found; a pipeline that reads no sink
  here is broken."""
  c = lm_experiment.get_config("control_tiny")
  c.model.num_loops = 1
  c.data.data_dir = str(tmp_path / "data")
  c.analyze.update(names=("stages",), max_depth=1)
  train.train_and_evaluate(c, tmp_path / "run")
  analyze.analyze(c, tmp_path / "run")
  st = json.loads((tmp_path / "run/analysis/stages.json").read_text())
  layer = st["stages"]["validation"]["positions"][1]
  assert layer["label"] == "r1 l1"
  assert layer["sink_rate"] == 1.0 and layer["sink_mass"] > 0.8
  uniform = st["stages"]["validation"]["colsum_uniform"]
  assert layer["colsum_concentration"] > uniform + 0.5
  # A checkpoint named by --step is analyzed beside the newest's, not over it;
  # the sweep report then draws the sink along training.
  newest = (tmp_path / "run/analysis/stages.json").read_bytes()
  analyze.analyze(c, tmp_path / "run", step=300)
  assert (tmp_path / "run/analysis/step_300/stages.json").exists()
  assert (tmp_path / "run/analysis/stages.json").read_bytes() == newest
  paths = lm_study.write(tmp_path, [tmp_path / "run"])
  assert [p.name for p in paths] == [
    "lm_study.md",
    "lm_study.png",
    "lm_study_sinks.png",
  ]
