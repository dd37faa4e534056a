"""Adaptive halting at inference: iterate the core until each example's answer settles.

`adaptive` runs the shared core in a `lax.while_loop` (one compiled program for
any number of iterations). After iteration t, example i halts when t >= r_min
and its criterion holds; a halted example's state and answer stop changing, and
the loop ends when every example has halted or at r_max. LTG compares an
iteration with the one before from the second on: r_min = 2 (r_min = 1 also
compares the first with the readout of the initial state). Criteria (p_t: the
answer distribution after iteration t, h_t: the state, T: the sequence length):

  kl_entropy      KL(p_t || p_{t-1}) < eps and H(p_t) < tau (LTG's rule; its
                  inference script: eps 1e-3, tau 3, up to 16 iterations)
  kl_entropy_len  KL(p_t || p_{t-1}) < eps and H(p_t) < tau + tau_len / T (LTG's
                  evaluation in training: eps 0.5, 3 + 12 / T with T its padded
                  length 50, up to 8 iterations; `seq_len` sets T, 0: the batch's)
  kl          KL(p_t || p_{t-1}) < eps
  kl_reverse  KL(p_{t-1} || p_t) < eps
  entropy     H(p_t) < tau
  latent      ||h_t - h_{t-1}|| / ||h_{t-1}|| < eps
  argmax      argmax p_t unchanged for `patience` iterations
  fixed       never: r_max iterations
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


def adaptive(
  model,
  tokens_BT,
  answer_pos_B,
  *,
  criterion: str = "kl_entropy",
  r_min: int = 1,
  r_max: int = 16,
  eps: float = 1e-3,
  tau: float = 3.0,
  tau_len: float = 12.0,
  seq_len: int = 0,
  patience: int = 2,
  unroll: int = 4,
  key=None,
):
  """(log-probabilities (B, V) at each example's halting iteration, iterations (B,)).

  The loop body runs `unroll` iterations (each still halts examples one by one),
  so the loop's own cost is paid once per `unroll` iterations; at most
  `unroll - 1` iterations are computed after the last example halts.
  """
  settled_fn = CRITERIA[criterion]
  T = seq_len or tokens_BT.shape[1]
  limits = Limits(eps, tau, patience, tau + tau_len / T)
  x_BTD, h_BTD = model.encode(tokens_BT, key)
  logp_BV = jax.nn.log_softmax(model.readout(h_BTD, answer_pos_B))
  B = tokens_BT.shape[0]
  init = (
    jnp.zeros((), jnp.int32),  # t: iterations run
    h_BTD,
    logp_BV,
    jnp.zeros(B, bool),  # halted
    jnp.zeros(B, jnp.int32),  # iterations used
    jnp.zeros(B, jnp.int32),  # argmax streak
  )

  def cond(carry):
    t, _, _, halted, _, _ = carry
    return (t < r_max) & ~halted.all()

  def one(carry):
    t, h, logp, halted, iters, streak = carry
    h_new = model.core_step(h, x_BTD)
    logp_new = jax.nn.log_softmax(model.readout(h_new, answer_pos_B))
    running = t < r_max  # False for an unrolled iteration past r_max
    t = t + running
    streak = jnp.where(logp_new.argmax(-1) == logp.argmax(-1), streak + 1, 0)
    settled = settled_fn(Step(logp_new, logp, h_new, h, streak), limits)
    active = ~halted & running
    return (
      t,
      h_new,  # a halted example's state may move on: its answer is frozen below
      jnp.where(active[:, None], logp_new, logp),
      halted | (active & settled & (t >= r_min)),
      jnp.where(active, t, iters),
      streak,
    )

  def body(carry):
    for _ in range(unroll):
      carry = one(carry)
    return carry

  _, _, logp_BV, _, iters_B, _ = jax.lax.while_loop(cond, body, init)
  return logp_BV, iters_B


class Step(NamedTuple):
  """What a criterion sees after iteration t, per example."""

  logp: jax.Array  # (B, V) answer log-probabilities after t
  logp_prev: jax.Array  # after t - 1
  h: jax.Array  # (B, T, D) the state after t
  h_prev: jax.Array
  streak: jax.Array  # (B,) iterations the argmax has not changed


class Limits(NamedTuple):
  eps: float
  tau: float
  patience: int
  tau_seq: float  # kl_entropy_len's entropy bound, tau + tau_len / T


def _kl(logp, logq):
  return (jnp.exp(logp) * (logp - logq)).sum(-1)


def _entropy(logp):
  return -(jnp.exp(logp) * logp).sum(-1)


def _latent(s: Step, eps):
  flat = lambda h: h.reshape(h.shape[0], -1)  # noqa: E731
  change = jnp.linalg.norm(flat(s.h - s.h_prev), axis=-1)
  return change < eps * jnp.linalg.norm(flat(s.h_prev), axis=-1)


# name -> whether each example's answer has settled (B,); `--mode=analyze` and
# config validation take their names from here.
CRITERIA = {
  "kl_entropy": lambda s, l: (
    (_kl(s.logp, s.logp_prev) < l.eps) & (_entropy(s.logp) < l.tau)
  ),
  "kl_entropy_len": lambda s, l: (
    (_kl(s.logp, s.logp_prev) < l.eps) & (_entropy(s.logp) < l.tau_seq)
  ),
  "kl": lambda s, l: _kl(s.logp, s.logp_prev) < l.eps,
  "kl_reverse": lambda s, l: _kl(s.logp_prev, s.logp) < l.eps,
  "entropy": lambda s, l: _entropy(s.logp) < l.tau,
  "latent": lambda s, l: _latent(s, l.eps),
  "argmax": lambda s, l: s.streak >= l.patience,
  "fixed": lambda s, l: jnp.zeros(s.logp.shape[0], bool),
}
