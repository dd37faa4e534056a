"""The mechanistic analyses against small hand-computed cases, and end to end."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from loopjax import config as config_lib
from loopjax.analysis import activations, attention, fixed_points, logit_lens, registry
from loopjax.analysis.record import Analysis
from loopjax.errors import ConfigError
from loopjax.kg import source as kg_source
from loopjax.kg import spec as kg_spec
from loopjax.lm import spec as lm_spec
from loopjax.model import LoopedTransformer

PAD = 9


def _batch(inputs, **columns):
  inputs = np.asarray(inputs, np.int32)
  return {
    "inputs": inputs,
    "answer_pos": (inputs != PAD).sum(-1).astype(np.int32) - 1,
    **{k: np.asarray(v, np.int32) for k, v in columns.items()},
  }


def test_colsum_of_a_known_attention_matrix():
  A_TS = np.array([[1, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]], np.float32)
  attn = jnp.asarray(A_TS)[None, None, None, None]  # (R, L, B, N, T, S) = 1s
  ex = attention.per_example({"core": {"attn": attn}}, _batch([[1, 2, 3]]), PAD)
  p_S = np.array([1.7, 0.8, 0.5]) / 3
  np.testing.assert_allclose(ex["profile"][0, 0, 0, 0], p_S, rtol=1e-6)
  np.testing.assert_allclose(ex["top_share"][0, 0, 0, 0], 1.7 / 3, rtol=1e-6)
  entropy = -(p_S * np.log(p_S)).sum()
  np.testing.assert_allclose(ex["entropy"][0, 0, 0, 0], entropy, rtol=1e-6)
  # A padding query's row does not count: the column sums of rows 0 and 1.
  ex = attention.per_example({"core": {"attn": attn}}, _batch([[1, 2, PAD]]), PAD)
  np.testing.assert_allclose(ex["profile"][0, 0, 0, 0], [0.75, 0.25, 0], atol=1e-7)
  np.testing.assert_allclose(
    ex["entropy"][0, 0, 0, 0],
    -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)),
    rtol=1e-6,
  )


def test_attention_stability_is_the_mean_total_variation():
  A = np.array([[1, 0], [0.5, 0.5]], np.float32)
  B = np.array([[1, 0], [0.9, 0.1]], np.float32)
  attn = jnp.asarray(np.stack([A, B, B]))[:, None, None, None]  # R = 3
  ex = attention.per_example({"core": {"attn": attn}}, _batch([[1, 2]]), PAD)
  # Row 0 unchanged, row 1 moves 0.4 of its mass: (0 + 0.4) / 2 queries.
  np.testing.assert_allclose(ex["stability"][0, :, 0, 0], [0.2, 0.0], atol=1e-7)
  summary = attention.summarize(jax.device_get(ex))
  np.testing.assert_allclose(summary["profile"][0][0], [0.95, 0.05], rtol=1e-6)


def _tiny_model(V=6, D=8):
  """A 1-layer model with tied embeddings = the first V unit vectors, RMSNorm
  with unit scale: logits(h) = sqrt(D) * h / ||h|| read on the first V dims."""
  from experiments import sysgen

  cfg = sysgen.get_config("tiny").model
  cfg.update(d_model=D, num_heads=2, norm_type="rmsnorm")
  model = LoopedTransformer(cfg, V, 3, rngs=nnx.Rngs(0))
  model.embed[...] = jnp.eye(V, D)
  return model


def test_logit_lens_ranks_under_a_known_unembedding():
  V, D = 6, 8
  model = _tiny_model(V, D)
  h = np.zeros((2, 1, 1, 3, D), np.float32)  # (R, L, B, T, D)
  h[0, 0, 0, 1, 4] = 2.0  # iteration 1: entity 4 at the relation position
  h[0, 0, 0, 2, 5] = 1.0  # and entity 5 at the answer position
  h[1, 0, 0, :, 5] = 3.0  # iteration 2: entity 5 everywhere
  trace = {"prelude": None, "coda": None, "core": {"hidden": jnp.asarray(h)}}
  batch = _batch([[0, 1, 2]], target=[5], bridge=[4])
  rank, prob = logit_lens.per_example(model, trace, batch)["core"]
  # (B, R, L, position, target): targets (bridge 4, answer 5)
  assert rank[0, :, 0].tolist() == [[[0, 1], [1, 0]], [[1, 0], [1, 0]]]
  top = math.exp(math.sqrt(D)) / (math.exp(math.sqrt(D)) + V - 1)
  np.testing.assert_allclose(prob[0, 0, 0, 0, 0], top, rtol=1e-4)
  np.testing.assert_allclose(prob[0, 0, 0, 0, 1], (1 - top) / (V - 1), rtol=1e-4)
  summary = logit_lens.summarize(
    jax.device_get(logit_lens.per_example(model, trace, batch)), batch["bridge"]
  )
  assert summary["examples"] == 1
  assert summary["core"]["bridge"]["relation"]["mrr"] == [[1.0], [0.5]]
  assert summary["core"]["answer"]["answer"]["top1"] == [[1.0], [1.0]]
  # Prelude and coda layers are read the same way, per layer.
  one_layer = {"hidden": jnp.asarray(h[1])}  # (P=1, B, T, D): entity 5 everywhere
  trace |= {"prelude": one_layer, "coda": one_layer}
  out = logit_lens.per_example(model, trace, batch)
  assert out["prelude"][0].shape == (1, 1, 2, 2)  # (B, P, position, target)
  assert out["coda"][0][0, 0].tolist() == [[1, 0], [1, 0]]
  # Atomic facts (no bridge) are left out.
  assert logit_lens.summarize({}, np.array([-1])) == {"examples": 0}


def unit_rms(h):
  """The scale-free reading of a stream without a model: unit RMS per token."""
  return h / jnp.sqrt((h * h).mean(-1, keepdims=True))


def _states(layers_RL):
  """(R, L, B=1, T=2, D) hidden states from a list of (L, D)-vectors per
  iteration, the same at both tokens."""
  h = np.asarray(layers_RL, np.float32)[:, :, None, None, :]
  return jnp.asarray(np.repeat(h, 2, 3))


# Jitted: one compile per shape, where its ops one by one each compile.
_from_stream = jax.jit(fixed_points.from_stream, static_argnums=1)


def _fixed(layers_RL, margin=0.01):
  real = np.ones((1, 2), bool)
  ex = _from_stream(_states(layers_RL), unit_rms, real)
  return ex, fixed_points.summarize(jax.device_get(ex), 1e-3, 0.9, margin)


def test_fixed_points_of_hand_made_trajectories():
  a, b, c = [1.0, 0.0], [0.0, 1.0], [2.0, 1.0]
  # Each layer settles from iteration 2 on, on its own state: cyclic.
  ex, s = _fixed([[c, b], [a, b], [a, b], [a, b]])
  u = np.array(c) / np.linalg.norm(c)
  np.testing.assert_allclose(
    ex["change"][0, 0, :, 0], [np.linalg.norm(u - a), 0, 0], rtol=1e-5
  )
  assert [x["converged_at"] for x in s["layers"]] == [2, 1]
  assert [x["period"] for x in s["layers"]] == [1, 1]
  assert s["kind"] == "cyclic fixed point"
  np.testing.assert_allclose(s["distance"], [[0, 2**0.5], [2**0.5, 0]], rtol=1e-6)
  # Both layers on one state, or limits closer than the margin: a fixed point.
  assert _fixed([[c, c], [a, a], [a, a]])[1]["kind"] == "fixed point"
  assert _fixed([[a, b], [a, b], [a, b]], margin=2.0)[1]["kind"] == "fixed point"
  # A block of one layer shows a fixed point, never a cycle of layers.
  assert _fixed([[c], [a], [a], [a]])[1]["kind"] == "fixed point"
  # Alternating states: a cycle of period 2, never converged.
  _, s = _fixed([[a, a], [b, b], [a, a], [b, b], [a, a]])
  assert s["kind"] == "cycle of period 2"
  assert [x["converged_at"] for x in s["layers"]] == [None, None]
  assert [x["period"] for x in s["layers"]] == [2, 2]


def test_a_growing_stream_whose_direction_is_fixed_has_converged():
  """A pre-norm stream adding the same update every iteration: its raw
  relative change falls like 1/r and never reaches tol, yet what the next
  layer reads (and the update) stop changing from the first iteration."""
  v, w = np.array([3.0, 1.0, 0.0]), np.array([0.0, 1.0, 2.0])
  _, s = _fixed([[r * v, r * w] for r in range(1, 17)])
  assert s["kind"] == "cyclic fixed point"
  assert [x["converged_at"] for x in s["layers"]] == [1, 1]
  np.testing.assert_allclose(s["layers"][0]["raw"][-1], 1 / 15, rtol=1e-5)
  np.testing.assert_allclose(s["layers"][0]["update"], 0, atol=1e-6)
  np.testing.assert_allclose(s["layers"][0]["cosine"], 1, atol=1e-6)
  assert set(s["layers"][0]["converged_at_tol"].values()) == {1}
  # A fixed offset: the direction converges like 1/r^2, the update at once.
  _, s = _fixed([[r * v + w, w] for r in range(1, 65)])
  change = np.asarray(s["layers"][0]["change"])
  assert change[0] > 0.1 and change[-1] < 1e-3
  ladder = list(s["layers"][0]["converged_at_tol"].values())  # 1e-1 .. 1e-3
  assert ladder == sorted(ladder) and ladder[0] < ladder[-1] <= 64
  np.testing.assert_allclose(s["layers"][0]["update"], 0, atol=1e-5)


def test_a_geometric_approach_converges_within_mechs_horizon():
  """A state approaching its limit by a factor 0.92 per iteration: not
  converged at tol 1e-3 within 32 iterations, converged within 128, and
  settled by MECH's distance to the 128th iterate too."""
  v, w = np.array([1.0, 2.0, 0.0]), np.array([0.0, -1.0, 1.0])
  traj = [[v + 0.92**r * w] for r in range(1, 129)]
  assert _fixed(traj[:32])[1]["layers"][0]["converged_at"] is None
  ex, s = _fixed(traj)
  layer = s["layers"][0]
  assert 32 < layer["converged_at"] < 128 and s["kind"] == "fixed point"
  assert 32 < layer["settled_at"] < 128
  np.testing.assert_allclose(ex["to_last"][0, 0, -1, 0], 0, atol=1e-7)
  assert layer["to_last"][0] > 1e-2 and layer["cosine_last"][-1] == pytest.approx(1)
  ladder = list(layer["settled_at_tol"].values())  # 1e-1 .. 1e-3
  assert ladder == sorted(ladder) and ladder[-1] == layer["settled_at"]


def test_convergence_is_decided_per_token():
  """One token that never settles cannot hide behind a larger one that has
  (a Frobenius norm over the sequence would); fp_share says how many may."""
  R, D = 8, 4
  rng = np.random.default_rng(0)
  h = np.zeros((R, 1, 1, 10, D), np.float32)
  h[:, :, :, :9] = 100.0 * rng.normal(size=D)  # 9 large tokens, settled
  h[:, :, :, 9] = rng.normal(size=(R, 1, 1, D))  # one small token, wandering
  ex = fixed_points.from_stream(jnp.asarray(h), unit_rms, np.ones((1, 10), bool))
  ex = jax.device_get(ex)
  assert fixed_points.summarize(ex, 1e-3, 0.9, 0.01)["layers"][0]["converged_at"] == 1
  s = fixed_points.summarize(ex, 1e-3, 0.95, 0.01)
  assert s["layers"][0]["converged_at"] is None and s["kind"] == "not converged"
  np.testing.assert_allclose(s["layers"][0]["converged_share"], 0.9)
  # The padding token is not counted.
  real = np.ones((1, 10), bool)
  real[0, 9] = False
  ex = fixed_points.from_stream(jnp.asarray(h), unit_rms, real)
  s = fixed_points.summarize(jax.device_get(ex), 1e-3, 1.0, 0.01)
  assert s["layers"][0]["converged_at"] == 1


def test_converged_from_needs_every_later_change_below_tol():
  change_NR = np.array(
    [[1, 1e-4, 1, 1e-4, 1e-4], [1e-4] * 5, [1e-4, 1e-4, 1e-4, 1e-4, 1.0]]
  )
  assert fixed_points.converged_from(change_NR, 1e-3).tolist() == [4, 1, np.inf]


def test_massive_activation_is_found_and_padding_ignored():
  h = np.ones((1, 1, 2, 3, 4), np.float32)  # (R, L, B, T, D)
  h[0, 0, :, 1, 3] = 100.0  # token 1, dim 3 in both examples
  h[0, 0, 0, 2, 0] = -1000.0  # a padding token of example 0: ignored
  batch = _batch([[1, 2, PAD], [1, 2, 3]])
  ex = activations.per_example({"core": {"hidden": jnp.asarray(h)}}, batch, PAD)
  s = activations.summarize(jax.device_get(ex), d_model=4)
  assert s["max"] == [[100.0]] and s["median"] == [[1.0]] and s["ratio"] == [[100.0]]
  assert (s["position"], s["dim"], s["share"]) == ([[1]], [[3]], [[1.0]])


def test_trace_is_the_forward_pass():
  """The traced layers end where the model's answer comes from, attention is
  causal, and every weight row is a distribution."""
  from experiments import sysgen

  cfg = sysgen.get_config("tiny").model
  cfg.update(num_prelude=1, num_layers=2, num_coda=1, injection="concat")
  model = LoopedTransformer(cfg, 30, 3, rngs=nnx.Rngs(0))
  tokens = jnp.array([[1, 2, 3], [4, 5, PAD]])
  pos = jnp.array([2, 1])
  # Jitted: one compile each, where op by op every op compiles.
  trace = nnx.jit(lambda m, t: m.trace(t, 3))(model, tokens)
  assert trace["core"]["hidden"].shape == (3, 2, 2, 3, cfg.d_model)
  assert trace["core"]["attn"].shape == (3, 2, 2, cfg.num_heads, 3, 3)
  h_BTD = trace["coda"]["hidden"][-1]
  answer = nnx.jit(lambda m, t, p: m(t, p, num_loops=3))(model, tokens, pos)
  logits = nnx.jit(lambda m, h: m.logits(h))(model, h_BTD[jnp.arange(2), pos])
  np.testing.assert_allclose(logits, answer, atol=1e-5)
  # Iteration r's last layer, through the coda, is the answer after r iterations.
  per_iteration = nnx.jit(lambda m, h_R, p: jax.vmap(lambda h: m.readout(h, p))(h_R))(
    model, trace["core"]["hidden"][:, -1], pos
  )
  _, logits_RBV = nnx.jit(lambda m, t, p: m(t, p, num_loops=3, per_iteration=True))(
    model, tokens, pos
  )
  np.testing.assert_allclose(per_iteration, logits_RBV, atol=1e-5)
  attn = np.asarray(trace["core"]["attn"])
  np.testing.assert_allclose(attn.sum(-1), 1, rtol=1e-5)
  assert np.all(np.triu(np.ones((3, 3)), 1) * attn == 0)


@pytest.fixture(scope="module")
def grokking_run(tmp_path_factory):
  """A tiny composition run with pretend phases at steps 20 and 40."""
  from experiments import ablations
  from loopjax import train

  root = tmp_path_factory.mktemp("lens")
  c = ablations.get_config("tiny")
  c.data.data_dir = str(root / "data")
  c.analyze.max_depth = 4
  train.train_and_evaluate(c, root / "run")
  (root / "run" / "phases.json").write_text(json.dumps({"memorize": 20, "id": 40}))
  return c, root / "run"


# ~19 s with its run; test_trace_is_the_forward_pass and the analysis unit tests stay.
@pytest.mark.slow
def test_analyze_and_the_ablation_table(grokking_run):
  from loopjax import analyze, report

  config, workdir = grokking_run
  config = config.copy_and_resolve_references()
  config.analyze.names = ("overthinking", *kg_spec.SHARED)
  paths = {p.name for p in analyze.analyze(config, workdir)}
  for name in config.analyze.names:
    assert {f"{name}.json", f"{name}.md", f"{name}.png"} <= paths
  assert "logit_lens_phases.png" in paths
  lens = json.loads((workdir / "analysis" / "logit_lens.json").read_text())
  assert [(p["phase"], p["step"]) for p in lens["phases"]] == [
    ("memorize", 20),
    ("id", 40),
  ]
  ood = lens["logit_lens"]["test_inferred_ood"]
  R, L = config.analyze.max_depth, config.model.num_layers
  assert np.shape(ood["core"]["bridge"]["relation"]["mrr"]) == (R, L)
  assert "core" not in lens["logit_lens"]["id_atomic"]  # no bridge: no lens
  attn = json.loads((workdir / "analysis" / "attention.json").read_text())
  profile = np.asarray(attn["attention"]["test_inferred_ood"]["profile"])
  np.testing.assert_allclose(profile.sum(-1), 1, rtol=1e-5)

  # The sweep report's ablation table: this run, as a one-run sweep.
  report.report(workdir.parent)
  (row,) = (workdir.parent / "ablations.md").read_text().splitlines()[2:]
  acc = json.loads((workdir / "analysis" / "overthinking.json").read_text())
  R = config.model.num_loops
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[:3] == [
    "run",
    f"1 x {R}",
    f"{acc['overthinking']['test_inferred_ood']['acc'][R - 1]:.3f}",
  ]
  fp = json.loads((workdir / "analysis" / "fixed_points.json").read_text())
  assert cells[5].startswith(fp["fixed_points"]["test_inferred_ood"]["kind"] + " (")
  profile = attn["attention"]["test_inferred_ood"]["profile"]
  shares = np.asarray(profile).mean((0, 1))  # over layers and heads
  assert cells[6] == " ".join(f"{x:.2f}" for x in shares)


def test_every_analysis_name_finds_its_record():
  """The registry's strings (read by config validation) agree with the records
  they name; a name without one is a one-line ConfigError, not a KeyError."""
  for table in (kg_spec.ANALYSES, lm_spec.ANALYSES):
    for name, entry in table.items():
      record = registry.record(table, name)
      assert (record.compute is None) == entry.shared, name
      assert (record.summarize is not None) == entry.shared, name
      per_example = entry.shared and table is kg_spec.ANALYSES
      assert (record.per_example is not None) == per_example, name
  with pytest.raises(ConfigError) as e:
    registry.record(lm_spec.ANALYSES, "logit_lens")  # a knowledge graph's only
  assert str(e.value) == (
    "analyze.names: each must be one of fixed_points, stages, attention, halting; "
    "got 'logit_lens'"
  )


def _toy_table(report):
  return "| split | norm |\n|---|---|\n" + "".join(
    f"| {s} | {v:.3f} |\n" for s, v in report["toy"].items()
  )


# A new analysis: this record plus one registry line (monkeypatched in below).
TOY = Analysis(
  per_example=lambda model, trace, batch, pad: jnp.linalg.norm(
    trace["core"]["hidden"][-1, -1], axis=-1
  ).mean(-1),  # (B,): the last iteration's mean state norm per example
  summarize=lambda ex, inputs: float(np.mean(ex["toy"])),
  table=_toy_table,
  summary=lambda report: f"{len(report['toy'])} splits",
)


def test_a_new_analysis_is_a_record_and_a_registry_line(tmp_path, monkeypatch, capsys):
  from experiments import sysgen
  from loopjax.data import kg
  from loopjax.kg import analyze as analyze_kg
  from loopjax.state import Model, build_model

  monkeypatch.setitem(
    kg_spec.ANALYSES, "toy", registry.Entry("test_analysis:TOY", shared=True)
  )
  c = sysgen.get_config("tiny")
  c.data.data_dir = str(tmp_path / "data")
  c.analyze.update(names=("toy",), max_depth=2)
  config_lib.validate(c)  # the registry line is all validation reads
  task = kg_source.knowledge_graph(c.data)
  graphdef, params = nnx.split(
    build_model(
      c.model, task.vocab.vocab_size, task.splits["train"]["inputs"].shape[1], 0
    )
  )
  written = analyze_kg.run(
    c, tmp_path, task, Model(graphdef, params), 0, tmp_path / "out", "id_atomic", False
  )
  assert [p.name for p in written] == ["toy.json", "toy.md"]
  report = json.loads((tmp_path / "out" / "toy.json").read_text())
  assert report["toy"].keys() == kg.probes(task, c.data.train_hops, 1).keys()
  assert capsys.readouterr().out.endswith(f"toy: {len(report['toy'])} splits\n")
