"""Batched generation with a key/value cache per recurrence: prompts of
different lengths in one batch, stop conditions, per-token exits.

Prompts are padded on the left, so every row's next token goes to the same
cache slot; each row's positions count from its first real slot and its
padding is never attended to (`LoopedTransformer.decode`'s `start_B`). The
prompts are one prefill call at the full R; each new token is one call of the
same compiled step at the next slot (the slot is an argument), so the cost
per token is one iteration stack over one position; the cache is donated to
each call and only the new token's entries are written (not a copy of it).

Every recurrence keeps its own keys and values (Huginn's "full" cache), or
with `cache_slots` M < R iteration r keeps them in slot r mod M (Huginn's
"compress-s" lookups: memory bounded by M whatever R). With an exit rule
(`halting.Rule.exit`) a new token iterates until the rule holds on its
next-token distribution (as `halting.adaptive` decides per token), then its
state is frozen: the recurrences it skipped get the keys and values of its
last one (Huginn's "latest" lookup), which is what later tokens attending at
those recurrences see. The prompt is always run at R.

A model on a mesh (all devices of all processes) generates with each batch
split over the `batch` rule's devices (`sharding.Feed`), its cache split
alike; every process holds every prompt and every new token, so each takes
the same steps. A sampled token depends on its row alone, not on the rows
padding the batch to the devices.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from loopjax import halting, sharding
from loopjax.errors import ConfigError
from loopjax.model.transformer import cached_iterations
from loopjax.state import Model


@dataclasses.dataclass
class Generation:
  """`tokens`: each row's new tokens, up to and including its eos or the
  token that met its stop condition; `iterations` (B, n): the recurrences of
  the step whose logits chose each token (entries past a row's end: padding);
  `logits` (B, n, V): the logits each token was chosen from, where kept."""

  tokens: list[list[int]]
  iterations: np.ndarray
  logits: np.ndarray | None = None


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0, length: int = 0):
  """(tokens (B, T), start_B): prompts right-aligned in T = the longest (or
  `length`, if longer: fewer shapes to compile), each row's first real slot."""
  T = max(length, *(len(p) for p in prompts))
  if min(len(p) for p in prompts) == 0:
    raise ValueError("generate: an empty prompt has no position to continue from")
  tokens_BT = np.full((len(prompts), T), pad_id, np.int32)
  for b, p in enumerate(prompts):
    tokens_BT[b, T - len(p) :] = p
  return tokens_BT, np.asarray([T - len(p) for p in prompts], np.int32)


@functools.partial(jax.jit, static_argnames=("num_loops",), donate_argnames=("cache",))
def prefill(model: Model, tokens_BT, cache, key, start_B, num_loops=None):
  """The prompts in one call: the last slot's logits (B, V), the cache
  filled. `key`: a random initial state's (Huginn's); `num_loops`: see
  `LoopedTransformer.decode`."""
  m = model.module()
  logits_BTV, cache = m.decode(tokens_BT, cache, 0, key, start_B, num_loops)
  return logits_BTV[:, -1], cache


@functools.partial(jax.jit, static_argnames=("num_loops",), donate_argnames=("cache",))
def decode_step(model: Model, token_B, cache, offset, key, start_B, num_loops=None):
  """One new token per row in slot `offset` (traced: one program for all)."""
  m = model.module()
  logits_BTV, cache = m.decode(token_B[:, None], cache, offset, key, start_B, num_loops)
  return logits_BTV[:, 0], cache


class _Carry(NamedTuple):
  t: jax.Array  # iterations run
  h: jax.Array  # (B, 1, D), frozen once a row exits
  logits: jax.Array  # (B, 1, V) the readout at each row's exit so far
  trail: halting.Trail  # what the next iteration is compared with, (B, 1)
  done: jax.Array  # (B,)
  iters: jax.Array  # (B,)
  kv: list  # per core layer, the token's keys and values at its last iteration


def empty_cache(model: Model, batch: int, length: int, slots: int, feed) -> dict:
  """`init_cache`'s zeros, made in place on `feed`'s mesh (rows split like
  the batch), or on one device without one."""
  module = model.module()

  def make():
    return module.init_cache(batch, length, slots, model.dtype)

  if feed.mesh is None:
    return make()
  rows = sharding.spec(("batch",), feed.rules, (batch,), feed.mesh)[0]

  def split(a):  # the batch: axis 0, or 1 behind a core layer's slots
    lead = (None,) * (a.ndim - 4)
    return NamedSharding(feed.mesh, PartitionSpec(*lead, rows))

  return jax.tree.map(  # zeros by shape: cached, not one program per call
    lambda a: jnp.zeros(a.shape, a.dtype, device=split(a)), jax.eval_shape(make)
  )


def programs(seq_len: int, num_loops: int, model: Model) -> dict:
  """`python -m loopjax.sample`'s two programs for one prompt of half a
  window, its cache as long as the window: the prefill and one new token,
  {name: (jitted fn, abstract args)} for ahead-of-time compiles."""
  T, S, R = seq_len // 2, seq_len, num_loops
  cache = jax.eval_shape(lambda m: m.module().init_cache(1, S, R, m.dtype), model)
  key = jax.eval_shape(lambda: jax.random.key(0))
  tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)
  token, offset = jax.ShapeDtypeStruct((1,), jnp.int32), jnp.int32(T)
  start = jax.ShapeDtypeStruct((1,), jnp.int32)
  return {
    f"sampling, prefill of {T} tokens": (prefill, (model, tokens, cache, key, start)),
    f"sampling, one token (cache of {S})": (
      decode_step,
      (model, token, cache, offset, key, start),
    ),
  }


@functools.partial(
  jax.jit, static_argnames=("rule", "num_loops"), donate_argnames=("cache",)
)
def exit_step(
  model: Model, token_B, cache, offset, key, start_B, rule: halting.Rule, num_loops=None
):
  """`decode_step` with each row's new token exiting by `rule`: (logits at
  its exit (B, V), the cache, the iterations it used (B,)). Every row runs
  the R iterations (one program, static shapes): an exit fixes what a token
  reads and leaves in the cache, not the step's compute."""
  m = model.module()
  x_BTD, h_BTD, new = m.decode_in(token_B[:, None], cache, offset, key, start_B)
  limits = rule.limits(None)  # one token: kl_entropy_len is no exit rule

  def read(h_BTD):  # the next-token logits from a state (B, 1, V)
    return m.decode_out(h_BTD, cache, offset, start_B)

  B, V = token_B.shape[0], m.unembedding.shape[-1]
  if rule.start == "uniform":  # nothing read yet: the first state is not
    logits = jnp.zeros((B, 1, V), jnp.float32)
  else:
    logits = read(m.end_iteration(h_BTD))

  def new_entry(a, slot):  # the new token's keys or values at `slot` (B, 1, K, H)
    B, _, K, H = a.shape[1:]
    return jax.lax.dynamic_slice(a, (slot, 0, offset, 0, 0), (1, B, 1, K, H))[0]

  init = _Carry(
    t=jnp.zeros((), jnp.int32),
    h=h_BTD,
    logits=logits,
    trail=rule.first(jax.nn.log_softmax(logits)),
    done=jnp.zeros((B,), bool),
    iters=jnp.zeros((B,), jnp.int32),
    kv=jax.tree.map(lambda a: new_entry(a, 0), cache["core"]),  # (a shape)
  )

  def iteration(c: _Carry, core_cache, slot):
    t = c.t + 1
    h_new, core_cache = m.cached_step(c.h, x_BTD, core_cache, slot, offset, start_B)
    done_B1 = c.done[:, None]
    # A row that has exited writes the keys and values of its last iteration.
    kv = jax.tree.map(
      lambda last, a: jnp.where(done_B1[..., None, None], last, new_entry(a, slot)),
      c.kv,
      core_cache,
    )
    core_cache = jax.tree.map(
      lambda a, n: jax.lax.dynamic_update_slice(a, n[None], (slot, 0, offset, 0, 0)),
      core_cache,
      kv,
    )
    logits = read(h_new)
    gate = rule.criterion == "gate"  # a model without one has none to read
    lam = jax.nn.sigmoid(m.exit_logit(h_new)) if gate else 0.0
    logp = jax.nn.log_softmax(logits)
    settled_B1, trail = rule.settled(c.trail, logp, h_new, c.h, lam, limits, True)
    carry = _Carry(
      t=t,
      h=jnp.where(done_B1[..., None], c.h, h_new),
      logits=jnp.where(done_B1[..., None], c.logits, logits),
      trail=trail,
      done=c.done | (settled_B1[:, 0] & (t >= rule.r_min)),
      iters=jnp.where(c.done, c.iters, t),
      kv=kv,
    )
    return carry, core_cache

  out, new["core"] = cached_iterations(iteration, init, cache["core"], num_loops)
  _, cache = m.decode_out(out.h, cache, offset, start_B, new)
  return out.logits[:, 0], cache, out.iters


def generate(
  model: Model,
  prompts,
  max_new_tokens: int,
  *,
  num_loops: int,
  temperature: float = 0.0,
  top_k: int = 0,
  seed: int = 0,
  eos_id: int | None = None,
  stop: Callable[[list[int]], bool] | None = None,
  exit: halting.Rule | None = None,
  cache_slots: int | None = None,
  keep_logits: bool = False,
  pad_to: tuple[int, int] = (0, 0),
  feed: sharding.Feed | None = None,
) -> Generation:
  """Continue each prompt (token ids; lengths may differ) by up to
  `max_new_tokens` tokens at `num_loops` recurrences (the most, with `exit`).
  temperature 0: greedy; top_k > 0: sample among the k likeliest. A row ends
  at `eos_id` or once `stop(its new tokens)` holds; the batch ends when every
  row has. `cache_slots` M < R: a bounded cache, iteration r in slot r mod M
  (memory M / R of the full one's). `pad_to` (rows, slots): the batch padded
  to at least that many rows (copies of the first prompt, ended from the
  start, not returned) and slots, so callers bound what compiles. `feed`:
  the model's (`sharding.Feed`: rows also padded to its devices), or none."""
  n, feed = len(prompts), feed or sharding.Feed(None, ())
  prompts = list(prompts) + [prompts[0]] * (feed.size(max(pad_to[0], n)) - n)
  tokens_BT, start_B = left_pad(prompts, length=pad_to[1])
  B, T = tokens_BT.shape
  M = cache_slots or num_loops
  if not 1 <= M <= num_loops:
    raise ConfigError(f"cache_slots: must be 1 .. num_loops ({num_loops})")
  cache = empty_cache(model, B, T + max_new_tokens, M, feed)
  R = num_loops if M < num_loops else None  # None: a slot per iteration

  def choose(logits_BV, key):
    if temperature <= 0:
      return logits_BV.argmax(-1)
    logits_BV = logits_BV / temperature
    if top_k:
      kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
      logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    keys_B = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(B))
    return jax.vmap(jax.random.categorical)(keys_B, logits_BV)

  prefill_key, key = jax.random.split(jax.random.key(seed))
  placed = feed.put({"tokens": tokens_BT, "start": start_B})
  start_B = placed["start"]
  logits_BV, cache = prefill(
    model, placed["tokens"], cache, prefill_key, start_B, num_loops=R
  )
  iters_B = np.full(B, num_loops)
  keys = jax.random.split(key, 2 * max_new_tokens).reshape(max_new_tokens, 2)
  new, ended = [[] for _ in range(B)], np.arange(B) >= n
  seen, used = [], []
  for i in range(max_new_tokens):
    token_B = choose(logits_BV, keys[i, 0]).astype(jnp.int32)
    if keep_logits:
      seen.append(sharding.host(logits_BV))
    used.append(iters_B)
    for b, t in enumerate(sharding.host(token_B).tolist()):
      if not ended[b]:
        new[b].append(t)
        ended[b] = t == eos_id or (stop is not None and stop(new[b]))
    if ended.all() or i + 1 == max_new_tokens:
      break
    offset = jnp.int32(T + i)
    args = (model, token_B, cache, offset, keys[i, 1], start_B)
    if exit is None:
      logits_BV, cache = decode_step(*args, num_loops=R)
    else:
      logits_BV, cache, iters_B = exit_step(*args, exit, num_loops=R)
      iters_B = sharding.host(iters_B)
  return Generation(
    tokens=new[:n],
    iterations=np.stack(used, 1)[:n],
    logits=np.stack(seen, 1)[:n] if keep_logits else None,
  )
