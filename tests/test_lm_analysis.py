"""A language model's analyses: stage statistics on hand-built cases, the
streamed pass against the full trace, its memory, and the written outputs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import lm as lm_experiment
from loopjax.analysis import attention, depth_scan, fixed_points, stages
from loopjax.data.lm import LmData
from loopjax.lm import analyze as analyze_lm
from loopjax.lm import spec as lm_spec
from loopjax.lm import study as lm_study
from loopjax.state import Model, build_model

V, T = 64, 24


def model(**overrides):
  c = lm_experiment.get_config("tiny").model
  c.update({"d_model": 16, "num_heads": 2, "num_layers": 2, "num_loops": 3} | overrides)
  return build_model(c, V, T, seed=0)


def lm_batch(B=2, T=T, seed=0, split_at=10):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (B, T + 1)).astype(np.int32)
  segments = np.zeros((B, T + 1), np.int32)
  segments[:, split_at:] = 1  # a second document from split_at on
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "segments": segments[:, :-1],
    "mask": (segments[:, 1:] == segments[:, :-1]).astype(np.float32),
    "real": np.ones((B, T), bool),
  }


def test_sink_mass_is_attention_on_each_documents_first_token():
  seg = jnp.asarray([[0, 0, 0, 1, 1]])
  first = stages.first_tokens(seg)
  assert first.tolist() == [[True, False, False, True, False]]
  A = np.zeros((1, 1, 5, 5), np.float32)
  A[0, 0, 0, 0] = 1.0
  A[0, 0, 1, :2] = [0.5, 0.5]
  A[0, 0, 2, :3] = [0.8, 0.1, 0.1]
  A[0, 0, 3, 3] = 1.0
  A[0, 0, 4, 3:] = [0.2, 0.8]
  heads, p_BNS = stages.head_stats(jnp.asarray(A), jnp.ones((1, 5), bool), first)
  # Queries 1, 2 (document 1) and 4 (document 2); the starts' own rows excluded.
  np.testing.assert_allclose(heads["sink"], [[(0.5 + 0.8 + 0.2) / 3]], rtol=1e-6)
  np.testing.assert_allclose(p_BNS[0, 0], A[0, 0].sum(0) / 5, rtol=1e-6)
  np.testing.assert_allclose(heads["top_share"], [[2.3 / 5]], rtol=1e-6)


def test_layer_statistics_of_known_states():
  D = 4
  batch = lm_batch(B=1, T=4, split_at=99)
  first = stages.first_tokens(jnp.asarray(batch["segments"]))
  logits = lambda h: jnp.zeros((*h.shape[:-1], V))  # uniform: loss log V
  # One direction, the first token 10x the others: entropy 0.
  h = np.zeros((1, 4, D), np.float32)
  h[0, :, 0] = [10.0, 1.0, 1.0, 1.0]
  s = jax.device_get(stages.layer_stats(jnp.asarray(h), batch, first, logits))
  np.testing.assert_allclose(s["entropy"], [0.0], atol=1e-6)
  np.testing.assert_allclose(s["first_norm"] / s["median_norm"], [10.0], rtol=1e-6)
  np.testing.assert_allclose(s["lens_loss"] / s["tokens"], [np.log(V)], rtol=1e-5)
  # One massive activation among ones: max / median |h| = 10.
  h = np.ones((1, 4, D), np.float32)
  h[0, 0, 0] = 10.0
  s = jax.device_get(stages.layer_stats(jnp.asarray(h), batch, first, logits))
  np.testing.assert_allclose(s["max_abs"] / s["median_abs"], [10.0], rtol=1e-6)
  np.testing.assert_allclose(
    s["first_norm"] / s["median_norm"], [103**0.5 / 2], rtol=1e-6
  )
  # Orthogonal tokens of equal norm: every direction used, entropy 1.
  s = jax.device_get(stages.layer_stats(jnp.eye(4)[None] * 3.0, batch, first, logits))
  np.testing.assert_allclose(s["entropy"], [1.0], rtol=1e-5)


@pytest.mark.parametrize("T, D", [(3, 8), (8, 3)])
def test_the_gram_eigenvalues_are_those_of_the_feature_gram(T, D):
  """The smaller Gram (Z Z^T when T < D) has Z^T Z's nonzero eigenvalues."""
  z = jnp.asarray(np.random.default_rng(0).normal(size=(2, T, D)), jnp.float32)
  want = np.linalg.eigvalsh(np.einsum("btd,bte->bde", z, z))[:, -min(T, D) :]
  got = jax.device_get(stages.gram_eigenvalues(z))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_repetition_is_the_share_of_variation_the_layer_explains():
  rows = lambda m_RL: [{"x": v} for v in np.asarray(m_RL, float).ravel()]
  assert stages.repetition(rows([[1, 5], [1, 5], [1, 5]]), "x", 2) == pytest.approx(1)
  assert stages.repetition(rows([[1, 1], [2, 2], [3, 3]]), "x", 2) == pytest.approx(0)
  assert stages.repetition(rows([[1, 1], [1, 1]]), "x", 2) is None  # constant
  assert stages.repetition(rows([[1], [2]]), "x", 1) is None  # one layer


@pytest.mark.parametrize(
  "injection, norm_position, state_norm",
  [
    pytest.param("add", "pre", False, marks=pytest.mark.slow),  # ~18 s each
    pytest.param("concat", "post", False, marks=pytest.mark.slow),
    pytest.param("add", "residual", True, marks=pytest.mark.slow),
  ],
)
def test_the_streamed_pass_equals_the_full_trace(injection, norm_position, state_norm):
  """The scan's per-iteration reductions give what the stacked trace gives:
  fixed points and attention token by token, the stage statistics per layer."""
  m = model(
    injection=injection,
    norm_position=norm_position,
    state_norm=state_norm,
    num_prelude=1,
    num_coda=1,
    norm_type="layernorm",
  )
  batch = lm_batch()
  R = 5
  streamed = jax.device_get(jax.jit(lambda b: depth_scan.run(m, b, R))(batch))
  trace = jax.jit(lambda b: m.trace(b["inputs"], R, segments_BT=b["segments"]))(batch)
  full_batch = {"inputs": batch["inputs"]}
  full = jax.device_get(fixed_points.per_example(m, trace, full_batch, pad_id=-1))
  for k in (*fixed_points.CURVES, "lag", "distance"):  # update: a difference of
    np.testing.assert_allclose(  # differences, float32 noise amplified
      streamed["fixed_points"][k], full[k], rtol=1e-3, atol=2e-5, err_msg=k
    )
  att = jax.device_get(attention.per_example(trace, full_batch, pad_id=-1))
  for k in ("top_share", "entropy", "stability"):
    np.testing.assert_allclose(streamed["attention"][k], att[k], atol=2e-5, err_msg=k)
  np.testing.assert_allclose(
    streamed["attention"]["profile"][:, 0], att["profile"][:, -1], atol=1e-6
  )
  first = stages.first_tokens(jnp.asarray(batch["segments"]))
  for r, l in ((0, 0), (R - 1, 1)):
    h_BTD = trace["core"]["hidden"][r, l]
    want = jax.device_get(stages.layer_stats(h_BTD, batch, first, m.logits))
    for k in ("lens_loss", "entropy", "max_abs", "first_norm", "median_norm"):
      np.testing.assert_allclose(streamed["core"][k][:, r, l], want[k], rtol=1e-4)
  assert (
    streamed["prelude"]["tokens"].shape == streamed["coda"]["tokens"].shape == (2, 1)
  )


def test_the_next_layer_reads_its_own_input():
  """Layer l's output is read by layer l+1's input norm; the last layer's by the
  first's, after the state norm and the injection; post-norm reads h as is."""
  m = model(norm_position="residual", state_norm=True, norm_type="layernorm")
  x = jax.random.normal(jax.random.key(0), (1, 4, 16))
  h_LBTD = jax.random.normal(jax.random.key(1), (2, 1, 4, 16))
  got = fixed_points.next_layer_reads(m, x)(h_LBTD)
  np.testing.assert_allclose(got[0], m.core[1].norm1(h_LBTD[0]), rtol=1e-6)
  want = m.core[0].norm1(m.inject(m.norm(h_LBTD[1]), x))
  np.testing.assert_allclose(got[1], want, rtol=1e-6)
  post = model(norm_position="post")
  np.testing.assert_allclose(
    fixed_points.next_layer_reads(post, x)(h_LBTD)[0], h_LBTD[0]
  )


def test_stages_summary_orders_depth_and_measures_repetition():
  """Positions run embedding, iteration x layer, and repetition reads the
  layer's share of the variation, from iteration 2 to the trained R and,
  apart, past it."""
  B, R, L, N = 2, 5, 2, 1
  ones = np.ones(B)

  def layer(loss):
    return {"lens_loss": loss * ones, "tokens": ones, "first_norm": 2 * ones,
            "median_norm": ones, "max_abs": 3 * ones, "median_abs": ones,
            "entropy": 0.5 * ones}  # fmt: skip

  # Iteration 1 a transient (loss 9); 2 and 3 (trained R = 3): layer 1 -> 4 and
  # layer 2 -> 1; past R, the layers agree and the iterations differ.
  loss_RL = np.array([[9.0, 9.0], [4.0, 1.0], [4.0, 1.0], [2.0, 2.0], [6.0, 6.0]])
  core = {k: np.stack([np.stack([layer(x)[k] for x in row], 1) for row in loss_RL], 1)
          for k in layer(0)}  # fmt: skip
  heads = {
    k: np.full((B, R, L, N), v)
    for k, v in (("sink", 0.5), ("top_share", 0.2), ("concentration", 0.3))
  }  # fmt: skip
  heads["sink"][:, 2, 1] = 0.1  # layer 2 of iteration 3: below the threshold
  ex = {"embed": layer(7.0), "prelude": None, "prelude_heads": None, "coda": None,
        "coda_heads": None, "core": core, "core_heads": heads,
        "uniform_concentration": np.full(B, 0.1)}  # fmt: skip
  s = stages.summarize(ex, threshold=0.3, trained=3)
  rows = s["positions"]
  assert s["colsum_uniform"] == pytest.approx(0.1)
  assert rows[0]["colsum_concentration"] is None
  assert rows[1]["colsum_concentration"] == pytest.approx(0.3)
  assert [r["label"] for r in rows] == [
    "embed",
    "r1 l1",
    "r1 l2",
    "r2 l1",
    "r2 l2",
    "r3 l1",
    "r3 l2",
    "r4 l1",
    "r4 l2",
    "r5 l1",
    "r5 l2",
  ]
  assert [r["lens_loss"] for r in rows[:7]] == [7.0, 9.0, 9.0, 4.0, 1.0, 4.0, 1.0]
  assert rows[0]["sink_rate"] is None and rows[1]["first_ratio"] == 2.0
  assert [r["sink_rate"] for r in rows[1:]] == [1, 1, 1, 1, 1, 0, 1, 1, 1, 1]
  assert s["repetition"]["lens_loss"] == pytest.approx(1.0)
  assert s["repetition_past"]["lens_loss"] == pytest.approx(0.0)
  assert s["repetition"]["massive_ratio"] is None  # constant


def test_the_sink_rate_thresholds_each_sequence_before_averaging():
  """Half the sequences sink (mass 0.9), half do not (0.1): rate 0.5. Averaging
  first (mass 0.5 against threshold 0.6) would read 0."""
  ones = np.ones(4)
  layer = {"lens_loss": ones, "tokens": ones, "first_norm": ones,
           "median_norm": ones, "max_abs": ones, "median_abs": ones,
           "entropy": ones}  # fmt: skip
  heads = {"sink": np.array([[0.9], [0.9], [0.1], [0.1]])} | {
    k: np.ones((4, 1)) for k in ("top_share", "concentration")
  }
  row = stages.position_summary(layer, heads, threshold=0.6)
  assert row["sink_rate"] == 0.5 and row["sink_mass"] == pytest.approx(0.5)


# ~13 s: two compiles of the analysis pass.
@pytest.mark.slow
def test_memory_does_not_grow_with_iterations():
  """A random LM at T = 128: the pass's temporary memory at R = 32 is that at
  R = 2 (a few iterations' attention weights: the carried previous one, the
  current one, their difference), far below the (R, L, B, N, T, T) stack."""
  m = model(num_heads=4)  # rope: any length
  batch = lm_batch(B=4, T=128, split_at=60)
  cfg = m.cfg
  mem = {}
  for R in (2, 32):
    compiled = jax.jit(lambda b, R=R: depth_scan.run(m, b, R)).lower(batch).compile()
    mem[R] = analyze_lm.memory(compiled, batch, R, cfg)
  assert mem[32]["temp_bytes"] < 1.25 * mem[2]["temp_bytes"]
  assert mem[32]["temp_bytes"] < 8 * mem[32]["attention_one_iteration_bytes"]
  assert mem[32]["temp_bytes"] < mem[32]["attention_all_iterations_bytes"] / 4


def test_analyze_writes_fixed_points_stages_and_attention(tmp_path):
  """The three outputs of an LM run, and the study's report row built from them."""
  config = lm_experiment.get_config("tiny")
  config.model.update(num_layers=2, num_prelude=1)
  config.analyze.update(max_depth=4, lm_windows=3, batch_size=2)
  rng = np.random.default_rng(0)
  n = 4 * config.data.seq_len + 1
  segments = np.repeat(np.arange(n // 20 + 1), 20)[:n].astype(np.int32)
  tokens = np.where(
    np.r_[True, segments[1:] != segments[:-1]], 1, rng.integers(3, 300, n)
  )
  stream = {"tokens": tokens.astype(np.int32), "segments": segments}
  task = LmData(
    "", 300, 0, 1, 2, config.data.seq_len, {"validation": stream}, "fp", align=True
  )
  # The rows training would draw (aligned: each starts at a <bos>).
  probe, num = analyze_lm.batches(task, 3, 2)
  assert num == 3 and [b["inputs"].shape[0] for b in probe] == [2, 2]
  assert all((b["inputs"][:, 0] == 1).all() for b in probe)
  graphdef, params = nnx.split(build_model(config.model, 300, config.data.seq_len, 0))
  out = tmp_path / "run" / "analysis"
  paths = analyze_lm.run(config, task, Model(graphdef, params), 7, out)
  assert sorted(p.name for p in paths) == sorted(
    f"{n}.{ext}" for n in lm_spec.SHARED for ext in ("json", "md", "png")
  )
  st = json.loads((out / "stages.json").read_text())
  assert st["step"] == 7 and st["windows"] == 3
  rows = st["stages"]["validation"]["positions"]
  labels = [r["label"] for r in rows]
  assert labels[:2] == ["embed", "prelude 1"] and labels[-1] == "r4 l2"
  assert len(rows) == 2 + 4 * 2
  fp = json.loads((out / "fixed_points.json").read_text())["fixed_points"]
  assert fp["validation"]["tokens"] == 3 * config.data.seq_len
  assert len(fp["validation"]["layers"][0]["change"]) == 3
  att = json.loads((out / "attention.json").read_text())["attention"]
  assert np.asarray(att["validation"]["sink"]).shape == (4, 2, config.model.num_heads)
  assert "MiB temporary" in (out / "stages.md").read_text()
  # The study's table: loss by iterations from the last evaluation record.
  run = out.parent
  (run / "config.json").write_text(json.dumps(config.to_dict()))
  record = {"step": 20, "eval/validation/loss": 5.0, "eval/validation/loss@4": 5.5}
  (run / "metrics").mkdir()
  (run / "metrics" / "0000000000001.jsonl").write_text(json.dumps(record) + "\n")
  md, png = lm_study.write(tmp_path, [run])
  assert png.exists()
  cells = md.read_text().splitlines()[2].split(" | ")
  assert cells[1:5] == ["add", "pre", "2 x 2", "5.000"]
  assert cells[5:8] == ["5.500", "-", "5.000 (2)"]  # @2R, @4R (not run), best
  change = fp["validation"]["layers"][-1]["change"][-1]
  assert cells[8] == f"{fp['validation']['kind']} (-, -); {change:.1e} at r = 3 -> 4"


def test_colsum_concentration_is_0_for_uniform_columns_and_1_for_one_key():
  """MECH's C = 1 - H(c) / log n: every query spreading evenly over all n keys
  gives 0, every query on key 0 gives 1; uniform causal attention gives its
  own baselines (C 0.18, top share 0.61 at n = 3), built per document."""
  B, N, T = 2, 1, 3
  real = jnp.ones((B, T), bool)

  def c(probs_BNTS):
    return attention.concentration(attention.colsum(probs_BNTS, real * 1.0), real)

  np.testing.assert_allclose(c(jnp.full((B, N, T, T), 1.0 / T)), 0.0, atol=1e-6)
  np.testing.assert_allclose(c(jnp.zeros((B, N, T, T)).at[..., 0].set(1)), 1, atol=1e-6)
  first = jnp.zeros((B, T), bool).at[:, 0].set(True)
  p = np.array([1 + 1 / 2 + 1 / 3, 1 / 2 + 1 / 3, 1 / 3]) / 3
  ref = 1 + (p * np.log(p)).sum() / np.log(3)
  base = attention.uniform(real, first)
  np.testing.assert_allclose(base["uniform_concentration"], ref, rtol=1e-5)
  np.testing.assert_allclose(base["uniform_top_share"], p[0], rtol=1e-5)
  assert abs(ref - 0.18) < 0.01 and abs(p[0] - 0.611) < 0.001
  # Two documents of 2 and 1 tokens: each its own causal baseline.
  two = attention.uniform(real, first.at[:, 2].set(True))
  np.testing.assert_allclose(two["uniform_top_share"], 0.5, rtol=1e-5)
