"""How many iterations answer a chain deeper than trained, chosen without its
answers.

LTG's claim is about chains of K + 1..K + 4 hops, and how long the model
thinks on them decides the figure. `--mode=eval`, the training loop's
evaluations and `--mode=report` give it three ways, side by side:

  fixed   `eval.extrapolation_depth` iterations (0: model.num_loops), set in
          the config before training
  halt    LTG's rule per chain: the first t in [r_min, r_max] where
          KL(p_t || p_{t-1}) < eps and H(p_t) < tau (else r_max); eps and tau
          tuned on the validation chains of the trained depths (`val_k<k>`,
          disjoint from the test chains; data.val_per_hop), or the config's
          where there are none
  oracle  the evaluated depth with the best accuracy on the test chains
          themselves: chosen on the test set, an upper bound, not a result
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from loopjax.halting import entropy_of, kl_of


def fixed_depth(config) -> int:
  """The depth set before training (eval.extrapolation_depth)."""
  return config.eval.extrapolation_depth or config.model.num_loops


def signals(logits_RBV):
  """(KL(p_t || p_{t-1}), H(p_t)), each (R, B), from the answer logits after
  iterations 1..R; the KL of iteration 1 (nothing before it here) is inf,
  never read (r_min >= 2). Traced inside the evaluator's step."""
  logp_RBV = jax.nn.log_softmax(logits_RBV.astype(jnp.float32))
  kl_RB = kl_of(logp_RBV[1:], logp_RBV[:-1])
  first_B = jnp.full(kl_RB.shape[1:], jnp.inf)
  return jnp.concatenate([first_B[None], kl_RB]), entropy_of(logp_RBV)


def halt_at(kl_RN, entropy_RN, eps: float, tau: float, r_min: int, r_max: int):
  """The iteration each example halts at (N,): the first t >= r_min whose
  answer settled (KL < eps, entropy < tau), else r_max."""
  settled_TN = (kl_RN[r_min - 1 : r_max] < eps) & (entropy_RN[r_min - 1 : r_max] < tau)
  return np.where(settled_TN.any(0), settled_TN.argmax(0) + r_min, r_max)


def halted(correct_RN, kl_RN, entropy_RN, eps, tau, r_min, r_max):
  """(accuracy, mean iterations) of the rule with thresholds eps, tau."""
  iters_N = halt_at(kl_RN, entropy_RN, eps, tau, r_min, r_max)
  correct_N = np.take_along_axis(correct_RN, iters_N[None] - 1, 0)[0]
  return float(correct_N.mean()), float(iters_N.mean())


def thresholds(examples: dict, cfg) -> tuple[float, float, list[str]]:
  """(eps, tau, the splits they were tuned on): the grid pair with the best
  mean accuracy over the `val_k<k>` splits in `examples` ({split: (loss,
  correct, kl, entropy)}, each (R, N)), ties to fewer iterations, then to
  the grids' order; the config's eps and tau where there are none."""
  val = sorted(n for n in examples if n.startswith("val_"))
  if not val:
    return cfg.eps, cfg.tau, []
  best = None
  for eps, tau in itertools.product(cfg.eps_grid, cfg.tau_grid):
    scores = [halted(*examples[n][1:], eps, tau, cfg.r_min, cfg.r_max) for n in val]
    key = (np.mean([a for a, _ in scores]), -np.mean([i for _, i in scores]))
    if best is None or key > best[0]:
      best = key, eps, tau
  return float(best[1]), float(best[2]), val


def report(examples: dict, cfg) -> dict:
  """The halting rule on every split: {split: {"acc", "iters", "eps", "tau",
  "tuned_on"}} (the thresholds the same for all); `cfg`: eval.halting."""
  eps, tau, tuned_on = thresholds(examples, cfg)
  out = {}
  for name, (_, correct_RN, kl_RN, entropy_RN) in examples.items():
    acc, iters = halted(correct_RN, kl_RN, entropy_RN, eps, tau, cfg.r_min, cfg.r_max)
    out[name] = dict(acc=acc, iters=iters, eps=eps, tau=tau, tuned_on=tuned_on)
  return out
