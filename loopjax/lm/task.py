"""The language-model family: next-token loss on packed text, validation loss
per iteration count. task.FAMILIES names it."""

import numpy as np

from loopjax import data, loss
from loopjax.data import lm
from loopjax.lm import evaluate, generate
from loopjax.task import Family


def text(data_cfg) -> lm.LmData:
  """A language model's token streams (data/lm.py), prepared under
  data.data_dir."""
  return data.prepared(lambda: lm.read(data_cfg), data_cfg)


class LanguageModel(Family):
  """Looped LMs trained from scratch, retrofitted or loaded pretrained."""

  name = "lm"
  loss_fn = staticmethod(loss.lm_loss_fn)
  reads_every_position = True
  packs_documents = True
  streams_analyses = True

  def load(self, config):
    return text(config.data)

  def train_iterator(self, config, task, rows):
    return lm.train_iterator(task, config.train.batch_size, config.seed, rows)

  def evaluator(self, config, task, graphdef, depths=(), mesh=None, shardings=None):
    """Every iteration count to max(eval.depths, R): `depths` is the config's."""
    return evaluate.LmEvaluator(graphdef, config, task, mesh, shardings)

  def eval_depths(self, config) -> list[int]:
    return evaluate.depths(config)

  def eval_step(self, config, graphdef, mesh=None, shardings=None):
    deepest = evaluate.depths(config)[-1]
    return evaluate.eval_step(config, graphdef, deepest, mesh, shardings)

  def eval_table(self, config, report: dict):
    """Loss, perplexity and accuracy at 1, R and the even iteration counts."""
    R, splits = config.model.num_loops, report["splits"]
    depths = [d for d in report["depths"] if d in (1, R) or d % 2 == 0]
    rows = [(k, splits["validation"][k]) for k in ("loss", "ppl", "acc")]
    return (
      f"validation at step {report['step']} by number of iterations R:",
      depths,
      rows,
    )

  def analyze(self, config, workdir, task, model, step, out_dir, phases=True):
    from loopjax.lm import analyze  # figures: matplotlib, not needed to train

    return analyze.run(config, task, model, step, out_dir)

  def sample(self, config, workdir, prompt: str, **kw) -> str:
    from loopjax.lm import sample

    return sample.sample(config, workdir, prompt, **kw)

  def sampling_programs(self, config, task, model) -> dict:
    return generate.programs(task.seq_len, config.model.num_loops, model)

  def without_examples(self, config):
    return lm.without_streams(config.data)

  def batch_shapes(self, config, task, batch_size: int) -> dict:
    """Packed windows: `segments` numbers each window's documents."""
    shape = (batch_size, task.seq_len)
    return {
      "inputs": (shape, np.int32),
      "targets": (shape, np.int32),
      "mask": (shape, np.float32),
      "segments": (shape, np.int32),
    }

  def random_batch(self, config, rng, vocab_size: int, seq_len: int) -> dict:
    """One document per sequence: nothing masked."""
    B = config.train.batch_size
    tokens = rng.integers(0, vocab_size, (B, seq_len + 1)).astype(np.int32)
    return {
      "inputs": tokens[:, :-1],
      "targets": tokens[:, 1:],
      "segments": np.zeros((B, seq_len), np.int32),
      "mask": np.ones((B, seq_len), np.float32),
    }
