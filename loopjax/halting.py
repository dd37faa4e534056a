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

A `Rule` is one of these with its thresholds, `r_min` and `start`: what the
halting sweeps (`grid`), generation's exits and the harness (`Rule.exit`)
all run. `start` sets what iteration 1 is compared with: "readout", the
readout of the initial state (LTG: then r_min 2 compares from the second
iteration on), or "uniform", nothing yet (Huginn's evaluators: a uniform
distribution, an entropy and an argmax that no distribution matches).
Huginn's `min_steps` 0 is r_min 1; with min_steps m > 0 its evaluators skip
their first m checks without updating what they compare against, which
loopjax does not mirror.

Per token, a token's answer freezes at its exit while every state iterates on
to the last exit, so later tokens attend to states run that far: the exits of
one full forward over the text, not of generation with a cache of each
token's own last iteration (Huginn's adaptive generation checks one new token
at a time: the per-example path, at the prompt's last position, is what its
parity test compares).
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from loopjax.errors import ConfigError
from loopjax.names import HALTING_START


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rule:
  """A halting rule: a criterion (one of `CRITERIA`), the thresholds it reads,
  the first iteration that may halt and what iteration 1 is compared with. A
  pytree whose leaves are the thresholds: a jitted function given one compiles
  once per criterion (sweeps); given it as a static argument, once per rule."""

  criterion: str = dataclasses.field(metadata=dict(static=True))
  eps: float = 1e-3
  tau: float = 3.0
  tau_len: float = 12.0
  patience: int = 2
  threshold: float = 0.5
  r_min: int = dataclasses.field(default=1, metadata=dict(static=True))
  start: str = dataclasses.field(default="readout", metadata=dict(static=True))
  seq_len: int = dataclasses.field(default=0, metadata=dict(static=True))

  @classmethod
  def exit(cls, criterion: str, threshold: float | None = None, **kw) -> "Rule":
    """A per-token exit rule (generation's, the harness's), its one threshold
    put where its criterion reads it (None: the default); start "uniform"
    unless `kw` says otherwise."""
    names = [c for c in CRITERIA if c != "kl_entropy_len"]
    if criterion not in names:  # kl_entropy_len's bound follows a padded length
      raise ConfigError(
        f"exit: {criterion!r} is not a per-token halting criterion (one of "
        f"{', '.join(names)})"
      )
    kw.setdefault("start", "uniform")
    if kw["start"] not in HALTING_START:
      raise ConfigError(f"start: must be one of {', '.join(HALTING_START)}")
    if threshold is not None and CRITERIA[criterion].reads:
      name = CRITERIA[criterion].reads[0]
      kw[name] = int(threshold) if name == "patience" else float(threshold)
    return cls(criterion, **kw)

  def row(self) -> dict:
    """The criterion and the thresholds it reads, as a table's row shows them."""
    reads = CRITERIA[self.criterion].reads
    return {"criterion": self.criterion} | {f: getattr(self, f) for f in reads}

  def check(self, model_cfg, field: str, name: str = "this model") -> None:
    """ConfigError (on `field`) unless the model `model_cfg` can run the rule."""
    if self.criterion == "gate" and not model_cfg.exit_gate:
      raise ConfigError(f"{field}: 'gate' reads an exit gate (Ouro's); {name} has none")

  def limits(self, T: int | None) -> "Limits":
    """The thresholds as criteria read them; `T`: the length kl_entropy_len's
    entropy bound follows (None: one token at a time, no length term)."""
    tau_seq = self.tau + self.tau_len / T if T else self.tau
    return Limits(self.eps, self.tau, self.patience, tau_seq, self.threshold)

  def first(self, logp) -> "Trail":
    """What iteration 1 is compared with, given the initial state's answer
    `logp` (U, V): it ("readout"), or ("uniform") a uniform distribution, an
    entropy and an argmax that no answer matches."""
    U = logp.shape[:-1]
    if self.start == "uniform":
      logp = jnp.full_like(logp, -jnp.log(logp.shape[-1]))
      entropy, argmax = jnp.full(U, jnp.inf), jnp.full(U, -1)
    else:
      entropy, argmax = entropy_of(logp), logp.argmax(-1)
    return Trail(logp, entropy, argmax, jnp.zeros(U, jnp.int32), jnp.zeros(U))

  def settled(self, trail: "Trail", logp, h, h_prev, lam, limits, per_token: bool):
    """(whether each unit's answer has settled (U,), the trail the next
    iteration compares with) after an iteration whose answer is `logp` and
    state `h` (`h_prev` before it); `lam`: the gate's chance of exiting now."""
    streak = jnp.where(logp.argmax(-1) == trail.argmax, trail.streak + 1, 0)
    cdf = trail.exit_cdf + lam * (1 - trail.exit_cdf)
    step = Step(logp, trail.logp, trail.entropy, h, h_prev, streak, cdf, per_token)
    new = Trail(logp, entropy_of(logp), logp.argmax(-1), streak, cdf)
    return CRITERIA[self.criterion].settled(step, limits), new


# The `analyze.halting` field holding each threshold's grid (a criterion's
# other thresholds are the field of their own name: tau, tau_len).
GRIDS = {"eps": "eps", "tau": "tau_grid", "patience": "patience", "threshold": "gate"}


def grid(cfg) -> list[Rule]:
  """The rules of the `analyze.halting` config: each criterion over the grid
  of the first threshold it reads."""
  rules = []
  for criterion in cfg.criteria:
    common = dict(r_min=cfg.r_min, start=cfg.start, seq_len=cfg.seq_len)
    swept, *fixed = CRITERIA[criterion].reads or (None,)
    common |= {f: cfg[f] for f in fixed}
    values = cfg[GRIDS[swept]] if swept else (None,)
    rules += [
      Rule(criterion, **common, **({swept: v} if swept else {})) for v in values
    ]
  return rules


def adaptive(
  model,
  tokens_BT,
  answer_pos_B=None,
  rule: Rule = Rule("kl_entropy"),
  *,
  r_max: int = 16,
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
  CRITERIA[rule.criterion]  # an unknown name: KeyError before any tracing
  rule.check(model.cfg, "analyze.halting.criteria")
  limits = rule.limits(rule.seq_len or tokens_BT.shape[1])
  per_token = answer_pos_B is None
  pos_BT = model.positions(tokens_BT, key)
  x_BTD, h_BTD = model.encode(tokens_BT, key, pos_BT=pos_BT)

  def answer(h_BTD):
    return jax.nn.log_softmax(model.readout(h_BTD, answer_pos_B, pos_BT=pos_BT))

  def exit_logit(h_BTD):
    if rule.criterion != "gate":  # a model without a gate has none to read
      return jnp.zeros(h_BTD.shape[: 2 if per_token else 1])
    if not per_token:
      h_BTD = jnp.take_along_axis(h_BTD, answer_pos_B[:, None, None], 1)
    g = model.exit_logit(h_BTD)
    return g if per_token else g[:, 0]

  # the initial state read as an iteration's output is
  trail = rule.first(answer(model.end_iteration(h_BTD)))
  U = trail.entropy.shape
  init = Carry(
    t=jnp.zeros((), jnp.int32),
    h=h_BTD,
    logp=trail.logp,  # a halted unit's: frozen
    trail=trail,
    halted=jnp.zeros(U, bool),
    iters=jnp.zeros(U, jnp.int32),
  )

  def cond(c):
    return (c.t < r_max) & ~c.halted.all()

  def one(c):
    h_new = model.core_step(c.h, x_BTD, pos_BT=pos_BT)
    logp_new = answer(h_new)
    running = c.t < r_max  # False for an unrolled iteration past r_max
    t = c.t + running
    lam = jax.nn.sigmoid(exit_logit(h_new))
    settled, trail = rule.settled(c.trail, logp_new, h_new, c.h, lam, limits, per_token)
    active = ~c.halted & running
    return Carry(
      t=t,
      h=h_new,
      logp=jnp.where(active[..., None], logp_new, c.logp),
      trail=trail,
      halted=c.halted | (active & settled & (t >= rule.r_min)),
      iters=jnp.where(active, t, c.iters),
    )

  def body(c):
    for _ in range(unroll):
      c = one(c)
    return c

  out = jax.lax.while_loop(cond, body, init)
  return out.logp, out.iters


class Trail(NamedTuple):
  """What a criterion compares an iteration with, per unit."""

  logp: jax.Array  # (U, V) the last iteration's answer
  entropy: jax.Array  # (U,) its entropy
  argmax: jax.Array  # (U,) its argmax
  streak: jax.Array  # (U,) iterations the argmax has not changed
  exit_cdf: jax.Array  # (U,) the gate's cumulative exit probability


class Carry(NamedTuple):
  t: jax.Array  # iterations run
  h: jax.Array  # (B, T, D)
  logp: jax.Array  # (U, V) each unit's answer, frozen once it halts
  trail: Trail
  halted: jax.Array
  iters: jax.Array  # (U,) iterations each unit used


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


class Limits(NamedTuple):
  eps: float
  tau: float
  patience: int
  tau_seq: float  # kl_entropy_len's entropy bound, tau + tau_len / T
  threshold: float  # the gate's cumulative exit probability


def kl_of(logp, logq):
  """KL(p || q) from log-probabilities, over the last axis."""
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


class Criterion(NamedTuple):
  """Whether each unit's answer has settled (U,), from a `Step` and `Limits`;
  the thresholds it reads, the first the one a grid sweeps."""

  settled: Callable[[Step, Limits], jax.Array]
  reads: tuple[str, ...] = ()


# One for each of `names.HALTING_CRITERIA`, the names config validation knows.
CRITERIA = {
  "kl_entropy": Criterion(
    lambda s, l: (kl_of(s.logp, s.logp_prev) < l.eps) & (entropy_of(s.logp) < l.tau),
    ("eps", "tau"),
  ),
  "kl_entropy_len": Criterion(
    lambda s, l: (
      (kl_of(s.logp, s.logp_prev) < l.eps) & (entropy_of(s.logp) < l.tau_seq)
    ),
    ("eps", "tau", "tau_len"),
  ),
  "kl": Criterion(lambda s, l: kl_of(s.logp, s.logp_prev) < l.eps, ("eps",)),
  "kl_reverse": Criterion(lambda s, l: kl_of(s.logp_prev, s.logp) < l.eps, ("eps",)),
  "entropy": Criterion(lambda s, l: entropy_of(s.logp) < l.tau, ("tau",)),
  "entropy_diff": Criterion(
    lambda s, l: jnp.abs(entropy_of(s.logp) - s.entropy_prev) < l.eps, ("eps",)
  ),
  "latent": Criterion(lambda s, l: _latent(s, l.eps), ("eps",)),
  "latent_diff": Criterion(lambda s, l: _latent_diff(s) < l.eps, ("eps",)),
  "cosine": Criterion(lambda s, l: _cosine_gap(s) < l.eps, ("eps",)),
  "argmax": Criterion(lambda s, l: s.streak >= l.patience, ("patience",)),
  "gate": Criterion(lambda s, l: s.exit_cdf >= l.threshold, ("threshold",)),
  "fixed": Criterion(lambda s, l: jnp.zeros(s.streak.shape, bool)),
}
