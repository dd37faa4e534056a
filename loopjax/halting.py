"""Adaptive halting at inference: iterate the core until each answer settles.

`adaptive` runs the shared core in a `lax.while_loop` (one compiled program for
any number of iterations). The unit that halts is an example (its answer at
`answer_pos_B`: a knowledge-graph answer, or a language model's next token
after a prompt) or, with `answer_pos_B` None, every token of a language model
(its next-token distribution). After iteration t, a unit halts when t >= r_min
and its criterion holds; a halted unit's answer stops changing (the states
iterate on: other tokens attend to them), and the loop ends when every unit
has halted or at r_max. Criteria (p_t: the answer distribution after
iteration t, h_t: the state, T: the sequence length):

  kl_entropy      KL(p_t || p_{t-1}) < eps and H(p_t) < tau (LTG's rule; its
                  inference script: eps 1e-3, tau 3, up to 16 iterations)
  kl_entropy_len  KL(p_t || p_{t-1}) < eps and H(p_t) < tau + tau_len / T (LTG's
                  evaluation in training: eps 0.5, 3 + 12 / T with T its padded
                  length 50, up to 8 iterations; `seq_len` sets T, 0: the batch's)
  kl          KL(p_t || p_{t-1}) < eps
  kl_reverse  KL(p_{t-1} || p_t) < eps (Huginn's "kl", eps 1e-3)
  entropy     H(p_t) < tau
  entropy_diff  |H(p_t) - H(p_{t-1})| < eps (Huginn's, 1e-3)
  latent      ||h_t - h_{t-1}|| / ||h_{t-1}|| < eps, over the example's whole
              state (a token's own, per token)
  latent_diff   ||h_t - h_{t-1}|| / ||h_t|| < eps per token, averaged over
              the sequence for an example, padding included (Huginn's
              "latent-diff", 0.03)
  cosine      1 - cos(h_t, h_{t-1}) < eps, likewise (Huginn's, 1e-3)
  argmax      argmax p_t unchanged for `patience` iterations (Huginn's
              "argmax-stability": 5)
  gate        the model's exit gate: the cumulative exit probability, with
              lambda_t = sigmoid(gate(h_t)) the chance of exiting at t given
              not before, reaches `threshold` (Ouro's; its last trained step
              takes the rest)
  fixed       never: r_max iterations

`start` sets what iteration 1 is compared with: "readout", the readout of the
initial state (LTG: then r_min 2 compares from the second iteration on), or
"uniform", nothing yet (Huginn's evaluators: a uniform distribution, an
entropy and an argmax that no distribution matches). Huginn's `min_steps` 0
is r_min 1; with min_steps m > 0 its evaluators skip their first m checks
without updating what they compare against, which loopjax does not mirror.

Per token, a token's answer freezes at its exit while every state iterates on
to the last exit, so later tokens attend to states run that far: the exits of
one full forward over the text, not of generation with a cache of each
token's own last iteration (Huginn's adaptive generation checks one new token
at a time: the per-example path, at the prompt's last position, is what its
parity test compares).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from loopjax.errors import ConfigError


def adaptive(
  model,
  tokens_BT,
  answer_pos_B=None,
  *,
  criterion: str = "kl_entropy",
  r_min: int = 1,
  r_max: int = 16,
  eps: float = 1e-3,
  tau: float = 3.0,
  tau_len: float = 12.0,
  seq_len: int = 0,
  patience: int = 2,
  threshold: float = 0.5,
  start: str = "readout",
  unroll: int = 4,
  key=None,
):
  """(log-probabilities (U, V) at each unit's halting iteration, iterations
  (U,)), U: the examples (B,) or, where `answer_pos_B` is None, the tokens
  (B, T).

  The loop body runs `unroll` iterations (each still halts units one by one),
  so the loop's own cost is paid once per `unroll` iterations; at most
  `unroll - 1` iterations are computed after the last unit halts.
  """
  settled_fn = CRITERIA[criterion]
  if criterion == "gate" and not model.cfg.exit_gate:
    raise ConfigError(
      "analyze.halting.criteria: 'gate' reads a model's exit gate (Ouro's); "
      "this model has none"
    )
  T = seq_len or tokens_BT.shape[1]
  limits = Limits(eps, tau, patience, tau + tau_len / T, threshold)
  per_token = answer_pos_B is None
  x_BTD, h_BTD = model.encode(tokens_BT, key)

  def answer(h_BTD):
    return jax.nn.log_softmax(model.readout(h_BTD, answer_pos_B))

  def exit_logit(h_BTD):
    if criterion != "gate":  # a model without a gate has none to read
      return jnp.zeros(h_BTD.shape[: 2 if per_token else 1])
    if not per_token:
      h_BTD = jnp.take_along_axis(h_BTD, answer_pos_B[:, None, None], 1)
    g = model.exit_logit(h_BTD)
    return g if per_token else g[:, 0]

  logp = answer(model.end_iteration(h_BTD))  # read as an iteration's output is
  U = logp.shape[:-1]
  if start == "uniform":
    logp = jnp.full_like(logp, -jnp.log(logp.shape[-1]))
    entropy, argmax = jnp.full(U, jnp.inf), jnp.full(U, -1)
  else:
    entropy, argmax = entropy_of(logp), logp.argmax(-1)
  init = Carry(
    t=jnp.zeros((), jnp.int32),
    h=h_BTD,
    logp=logp,  # a halted unit's: frozen
    logp_prev=logp,
    entropy=entropy,
    argmax=argmax,
    exit_cdf=jnp.zeros(U),
    halted=jnp.zeros(U, bool),
    iters=jnp.zeros(U, jnp.int32),
    streak=jnp.zeros(U, jnp.int32),
  )

  def cond(c):
    return (c.t < r_max) & ~c.halted.all()

  def one(c):
    h_new = model.core_step(c.h, x_BTD)
    logp_new = answer(h_new)
    running = c.t < r_max  # False for an unrolled iteration past r_max
    t = c.t + running
    lam = jax.nn.sigmoid(exit_logit(h_new))
    step = next_step(c, logp_new, h_new, lam, per_token)
    settled = settled_fn(step, limits)
    active = ~c.halted & running
    return Carry(
      t=t,
      h=h_new,
      logp=jnp.where(active[..., None], logp_new, c.logp),
      logp_prev=logp_new,
      entropy=entropy_of(logp_new),
      argmax=logp_new.argmax(-1),
      exit_cdf=step.exit_cdf,
      halted=c.halted | (active & settled & (t >= r_min)),
      iters=jnp.where(active, t, c.iters),
      streak=step.streak,
    )

  def body(c):
    for _ in range(unroll):
      c = one(c)
    return c

  out = jax.lax.while_loop(cond, body, init)
  return out.logp, out.iters


class Carry(NamedTuple):
  t: jax.Array  # iterations run
  h: jax.Array  # (B, T, D)
  logp: jax.Array  # (U, V) each unit's answer, frozen once it halts
  logp_prev: jax.Array  # (U, V) the last iteration's answer
  entropy: jax.Array  # (U,) its entropy
  argmax: jax.Array  # (U,) its argmax
  exit_cdf: jax.Array  # (U,) the gate's cumulative exit probability
  halted: jax.Array
  iters: jax.Array  # (U,) iterations each unit used
  streak: jax.Array  # (U,) iterations the argmax has not changed


class Step(NamedTuple):
  """What a criterion sees after iteration t, per unit."""

  logp: jax.Array  # (U, V) answer log-probabilities after t
  logp_prev: jax.Array  # after t - 1
  entropy_prev: jax.Array  # (U,) H(p_{t-1})
  h: jax.Array  # (B, T, D) the state after t
  h_prev: jax.Array
  streak: jax.Array  # (U,) iterations the argmax has not changed
  exit_cdf: jax.Array  # (U,) the gate's cumulative exit probability
  per_token: bool  # U = (B, T), not (B,)


def next_step(c, logp, h, lam, per_token: bool) -> Step:
  """What a criterion sees after an iteration whose answer is `logp` and state
  `h`, given the carry `c` of the one before (its logp_prev, entropy, argmax,
  streak, exit_cdf and h; any loop's that halts by these criteria) and
  `lam`, the gate's chance of exiting now (0 without a gate)."""
  streak = jnp.where(logp.argmax(-1) == c.argmax, c.streak + 1, 0)
  cdf = c.exit_cdf + lam * (1 - c.exit_cdf)
  return Step(logp, c.logp_prev, c.entropy, h, c.h, streak, cdf, per_token)


class Limits(NamedTuple):
  eps: float
  tau: float
  patience: int
  tau_seq: float  # kl_entropy_len's entropy bound, tau + tau_len / T
  threshold: float  # the gate's cumulative exit probability


def _kl(logp, logq):
  return (jnp.exp(logp) * (logp - logq)).sum(-1)


def entropy_of(logp):
  return -(jnp.exp(logp) * logp).sum(-1)


def _latent(s: Step, eps):
  """||h_t - h_{t-1}|| < eps ||h_{t-1}||, per example (its whole state) or token."""
  unit = (lambda h: h) if s.per_token else (lambda h: h.reshape(h.shape[0], -1))
  change = jnp.linalg.norm(unit(s.h - s.h_prev), axis=-1)
  return change < eps * jnp.linalg.norm(unit(s.h_prev), axis=-1)


def _token_mean(s: Step, x_BT):
  """Per token, or its mean over the sequence for an example (Huginn's reduce)."""
  return x_BT if s.per_token else x_BT.mean(-1)


def _latent_diff(s: Step):
  norm = lambda h: jnp.linalg.norm(h, axis=-1)  # noqa: E731
  return _token_mean(s, norm(s.h - s.h_prev) / norm(s.h))


def _cosine_gap(s: Step):
  dot = (s.h * s.h_prev).sum(-1)
  cos = dot / jnp.linalg.norm(s.h, axis=-1) / jnp.linalg.norm(s.h_prev, axis=-1)
  return _token_mean(s, 1 - cos)


# name -> whether each unit's answer has settled (U,); one for each of
# `names.HALTING_CRITERIA`, the names config validation knows.
CRITERIA = {
  "kl_entropy": lambda s, l: (
    (_kl(s.logp, s.logp_prev) < l.eps) & (entropy_of(s.logp) < l.tau)
  ),
  "kl_entropy_len": lambda s, l: (
    (_kl(s.logp, s.logp_prev) < l.eps) & (entropy_of(s.logp) < l.tau_seq)
  ),
  "kl": lambda s, l: _kl(s.logp, s.logp_prev) < l.eps,
  "kl_reverse": lambda s, l: _kl(s.logp_prev, s.logp) < l.eps,
  "entropy": lambda s, l: entropy_of(s.logp) < l.tau,
  "entropy_diff": lambda s, l: jnp.abs(entropy_of(s.logp) - s.entropy_prev) < l.eps,
  "latent": lambda s, l: _latent(s, l.eps),
  "latent_diff": lambda s, l: _latent_diff(s) < l.eps,
  "cosine": lambda s, l: _cosine_gap(s) < l.eps,
  "argmax": lambda s, l: s.streak >= l.patience,
  "gate": lambda s, l: s.exit_cdf >= l.threshold,
  "fixed": lambda s, l: jnp.zeros(s.streak.shape, bool),
}
