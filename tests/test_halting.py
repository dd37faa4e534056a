"""Adaptive halting: each example stops where a step-by-step reference says."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopjax import halting
from loopjax.state import build_model

R_MAX, R_MIN, B = 8, 2, 64


@pytest.fixture(scope="module")
def setup():
  from experiments import sysgen

  c = sysgen.get_config("tiny")
  c.model.init_std = 0.5  # a random model whose answers move between iterations
  model = build_model(c.model, 33, 3, 0)
  tokens = jax.random.randint(jax.random.key(1), (B, 3), 0, 32)
  pos = jnp.full(B, 2)
  # Reference: the core applied step by step, outside any loop construct.
  x, h0 = model.encode(tokens)
  hs, logps = [h0], []
  logps.append(jax.nn.log_softmax(model.readout(hs[0], pos)))
  for _ in range(R_MAX):
    hs.append(model.core_step(hs[-1], x))
    logps.append(jax.nn.log_softmax(model.readout(hs[-1], pos)))
  return model, tokens, pos, np.stack(hs), np.stack(logps)


def _signals(hs, logps):
  """Per iteration t = 1..R_MAX and example: KL both ways, entropy, latent change,
  argmax streak."""
  p = np.exp(logps)
  kl = (p[1:] * (logps[1:] - logps[:-1])).sum(-1)
  kl_rev = (p[:-1] * (logps[:-1] - logps[1:])).sum(-1)
  ent = -(p[1:] * logps[1:]).sum(-1)
  flat = hs.reshape(hs.shape[0], hs.shape[1], -1)
  latent = np.linalg.norm(flat[1:] - flat[:-1], axis=-1) / np.linalg.norm(
    flat[:-1], axis=-1
  )
  same = logps[1:].argmax(-1) == logps[:-1].argmax(-1)
  streak = np.zeros_like(same, int)
  for t in range(len(same)):
    streak[t] = np.where(same[t], (streak[t - 1] if t else 0) + 1, 0)
  return kl, kl_rev, ent, latent, streak


@pytest.mark.parametrize(
  "criterion",
  ["kl_entropy", "kl_entropy_len", "kl", "kl_reverse", "entropy", "latent", "argmax"],
)
def test_halts_where_the_reference_says(setup, criterion):
  model, tokens, pos, hs, logps = setup
  kl, kl_rev, ent, latent, streak = _signals(hs, logps)
  eps = {"kl": np.median(kl[R_MIN - 1 :]), "kl_reverse": np.median(kl_rev[R_MIN - 1 :])}
  eps["kl_entropy"] = eps["kl_entropy_len"] = eps["kl"]
  eps["latent"] = np.median(latent[R_MIN - 1 :])
  tau = float(np.median(ent[R_MIN - 1 :]))
  ok = {
    "kl_entropy": (kl < eps["kl"]) & (ent < tau),
    "kl_entropy_len": (kl < eps["kl"]) & (ent < tau),  # its bound: tau' + 12 / 50
    "kl": kl < eps["kl"],
    "kl_reverse": kl_rev < eps["kl_reverse"],
    "entropy": ent < tau,
    "latent": latent < eps["latent"],
    "argmax": streak >= 2,
  }[criterion]
  ok[: R_MIN - 1] = False
  expected = np.where(ok.any(0), ok.argmax(0) + 1, R_MAX)
  assert 1 < len(set(expected)) and (expected < R_MAX).any()  # a real mix
  logp, iters = jax.jit(
    lambda t, p: halting.adaptive(
      model,
      t,
      p,
      halting.Rule(
        criterion,
        r_min=R_MIN,
        eps=float(eps.get(criterion, 0.0)),
        tau=tau - 12 / 50 if criterion == "kl_entropy_len" else tau,
        tau_len=12.0,
        seq_len=50,
        patience=2,
      ),
      r_max=R_MAX,
    )
  )(tokens, pos)
  iters = np.asarray(iters)
  agree = iters == expected  # thresholds are medians: a float tie may flip one
  assert agree.mean() >= 0.95, (iters, expected)
  np.testing.assert_allclose(
    np.asarray(logp)[agree], logps[iters[agree], np.flatnonzero(agree)], atol=1e-4
  )


def test_fixed_runs_r_max_like_the_model(setup):
  model, tokens, pos, _, logps = setup
  logp, iters = halting.adaptive(model, tokens, pos, halting.Rule("fixed"), r_max=R_MAX)
  assert (np.asarray(iters) == R_MAX).all()
  np.testing.assert_allclose(logp, logps[R_MAX], atol=1e-4)
  direct = jax.nn.log_softmax(model(tokens, pos, num_loops=R_MAX))
  np.testing.assert_allclose(logp, direct, atol=1e-4)


def test_unknown_criterion():
  with pytest.raises(KeyError, match="'x'"):  # config.validate's one line: test_config
    rule = halting.Rule("x")
    halting.adaptive(None, jnp.zeros((1, 3), int), jnp.zeros(1, int), rule)


def test_every_criterion_config_names_has_a_rule():
  from loopjax.names import HALTING_CRITERIA, HALTING_LTG

  assert tuple(halting.CRITERIA) == HALTING_CRITERIA
  assert set(HALTING_LTG) <= set(HALTING_CRITERIA)


def test_grid_sweeps_each_criterions_first_threshold():
  """`analyze.halting` -> rules: each criterion over the grid of the first
  threshold it reads, the others from their own fields; a row shows the
  criterion and the thresholds it reads."""
  from loopjax import config as config_lib

  cfg = config_lib.base().analyze.halting
  cfg.criteria = ("kl_entropy_len", "entropy", "argmax", "gate", "fixed")
  rules = halting.grid(cfg)
  assert [r.row() for r in rules] == (
    [{"criterion": "kl_entropy_len", "eps": e, "tau": cfg.tau, "tau_len": cfg.tau_len}
     for e in cfg.eps]
    + [{"criterion": "entropy", "tau": t} for t in cfg.tau_grid]
    + [{"criterion": "argmax", "patience": p} for p in cfg.patience]
    + [{"criterion": "gate", "threshold": q} for q in cfg.gate]
    + [{"criterion": "fixed"}]
  )  # fmt: skip
  assert {(r.r_min, r.start, r.seq_len) for r in rules} == {
    (cfg.r_min, cfg.start, cfg.seq_len)
  }


def test_an_exit_rule_puts_its_threshold_where_its_criterion_reads_it():
  from loopjax.errors import ConfigError

  assert halting.Rule.exit("kl", 0.01) == halting.Rule("kl", eps=0.01, start="uniform")
  assert halting.Rule.exit("entropy", 2).tau == 2.0
  assert halting.Rule.exit("argmax", 3.0).patience == 3
  assert halting.Rule.exit("gate", 0.7, start="readout").threshold == 0.7
  with pytest.raises(ConfigError, match="not a per-token halting criterion"):
    halting.Rule.exit("kl_entropy_len", 0.5)


def test_a_rules_thresholds_are_its_leaves():
  """Traced under jit (a sweep compiles once per criterion), the rest static."""
  leaves, treedef = jax.tree.flatten(halting.Rule("kl", eps=0.1, r_min=2))
  assert leaves == [0.1, 3.0, 12.0, 2, 0.5]
  assert jax.tree.unflatten(treedef, leaves).r_min == 2
