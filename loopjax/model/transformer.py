"""LoopedTransformer: embed -> prelude -> core^R -> coda -> norm -> unembed."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from loopjax import recurrence, sharding
from loopjax.model.layers import Block, Norm, param, positions, zeros


def sinusoidal(max_len: int, d: int) -> np.ndarray:
  pos_T1 = np.arange(max_len)[:, None]
  freq_H = np.exp(-np.log(10_000.0) * np.arange(0, d, 2) / d)
  pe_TD = np.zeros((max_len, d), np.float32)
  pe_TD[:, 0::2] = np.sin(pos_T1 * freq_H)
  pe_TD[:, 1::2] = np.cos(pos_T1 * freq_H[: d // 2])
  return pe_TD


class LoopedTransformer(nnx.Module):
  """A block of L layers whose weights are shared across R iterations.

  `cfg` is the `model` section of the config. The knowledge-graph tasks read
  the answer at `answer_pos_B` (the last real token); with `per_iteration=True`
  the call also returns the answer logits after each iteration, (R, B, V).
  A language model (`answer_pos_B` None) reads logits at every position,
  (B, T, V); `segments_BT` keeps attention inside each packed document.
  """

  def __init__(self, cfg, vocab_size: int, max_len: int, *, rngs: nnx.Rngs):
    self.cfg, self.max_len = cfg, max_len
    d = cfg.d_model
    normal = nnx.initializers.normal(cfg.init_std)
    embedding = nnx.initializers.normal(cfg.embed_init_std)  # tokens and positions
    self.embed = param(rngs, embedding, (vocab_size, d), ("vocab", "embed"))
    self.pos = (
      param(rngs, embedding, (max_len, d), (None, "embed"))
      if cfg.pos_encoding == "learned"
      else None
    )
    self.prelude = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_prelude)])
    self.core = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.coda = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_coda)])
    if cfg.injection == "concat":
      self.adapter = param(rngs, normal, (2 * d, d), (None, "embed"))
      self.adapter_b = zeros(rngs, (d,), ("embed",))
    self.norm = Norm(d, cfg.norm_type, rngs=rngs, eps=cfg.norm_eps)
    if cfg.exit_gate:  # Ouro's: a per-token exit probability from each state
      self.gate_w = param(rngs, normal, (d,), ("embed",))
      self.gate_b = zeros(rngs, (), ())
    self.unembed = (
      None
      if cfg.tie_embeddings
      else param(rngs, normal, (d, vocab_size), ("embed", "vocab"))
    )

  def embed_tokens(self, tokens_BT, offset=0, start_B=None):
    """Token (and absolute position) embeddings; `offset`: the first token's
    slot (decoding with a cache; may be traced), `start_B`: each row's first
    real slot (left-padded prompts), from which its positions count."""
    # The table whole, as FSDP gathers any weight before use: a lookup in a
    # table split over `embed` would reshard its (B, T, D) cotangent by full
    # rematerialization in the backward scatter.
    table_VD = sharding.constrain(self.embed[...], (None, None))
    x_BTD = sharding.constrain(table_VD[tokens_BT], ("batch", None, None))
    if self.cfg.embed_scale != 1.0:  # Huginn, Gemma: sqrt(d_model)
      x_BTD = x_BTD * jnp.asarray(self.cfg.embed_scale, x_BTD.dtype)
    T, D = x_BTD.shape[1:]
    kind = self.cfg.pos_encoding
    if kind in ("learned", "sinusoidal"):
      table = self.pos[...] if kind == "learned" else sinusoidal(self.max_len, D)
      if start_B is None:
        pos_1TD = jax.lax.dynamic_slice_in_dim(table, offset, T)[None]
      else:
        pos_1TD = jnp.asarray(table)[positions(offset, T, start_B)]
      x_BTD = x_BTD + pos_1TD.astype(x_BTD.dtype)
    return x_BTD

  def initial_state(self, x_BTD, key):
    if self.cfg.init_state == "embedding":
      return x_BTD
    if self.cfg.init_state == "zeros":
      return jnp.zeros_like(x_BTD)
    if key is None:  # not jax.random's TypeError on None deep in the trace
      raise ValueError(
        f"model.init_state={self.cfg.init_state!r} draws the first state at random: "
        "pass a key (jax.random.key) to this forward"
      )
    if self.cfg.init_state == "trunc_normal":  # Huginn's
      z = jax.random.truncated_normal(key, -3.0, 3.0, x_BTD.shape, jnp.float32)
      return (z * self.cfg.init_state_std).astype(x_BTD.dtype)
    return jax.random.normal(key, x_BTD.shape, x_BTD.dtype)  # Huginn-style

  def positions(self, tokens_BT, key):
    """Each row's rotary positions (B, T), or None (0..T-1): with
    `random_positions` P, T distinct positions in [0, P) drawn per row and
    sorted (Ruoss et al. 2023), in training and evaluation alike, so a chain
    longer than any trained on is read at relative offsets seen in training.
    The draw is keyed by `key` folded with 2 (1: the sampled depth)."""
    P = self.cfg.random_positions
    if not P:
      return None
    if key is None:
      raise ValueError("model.random_positions draws positions: pass a key")
    B, T = tokens_BT.shape
    u_BP = jax.random.uniform(jax.random.fold_in(key, 2), (B, P))
    return jnp.sort(jnp.argsort(u_BP, -1)[:, :T], -1)

  def encode(self, tokens_BT, key=None, segments_BT=None, pos_BT=None):
    """(x_BTD, h_BTD): the input the core sees each iteration, and its first
    state; `pos_BT`: rotary positions (`positions`)."""
    x_BTD = self._unlooped(
      self.prelude, self.embed_tokens(tokens_BT), segments_BT, pos_BT
    )
    return x_BTD, self.initial_state(x_BTD, key)

  def _unlooped(self, blocks, h_BTD, segments_BT, pos_BT=None):
    """h through the prelude's or coda's `blocks`, each rematerialized in its
    backward pass by `remat`'s policy as the core's iterations are (with
    "full": `lm.py:gpu`'s temporaries per H200, 1.65 -> 1.26 GiB)."""
    for block in blocks:
      apply = lambda h, block=block: block(h, segments_BT=segments_BT, pos_BT=pos_BT)  # noqa: E731
      if self.cfg.remat != "none":
        apply = jax.checkpoint(apply, policy=recurrence.REMAT_POLICIES[self.cfg.remat])
      h_BTD = apply(h_BTD)
    return h_BTD

  def inject(self, h_BTD, x_BTD):
    """The state an iteration starts from: the input injected into it."""
    if self.cfg.injection == "add":
      return h_BTD + x_BTD
    if self.cfg.injection == "concat":
      lead = (1,) * (h_BTD.ndim - 1)  # any leading axes (the analyses' stacks)
      return jnp.concatenate(
        [h_BTD, x_BTD], -1
      ) @ self.adapter + self.adapter_b.reshape(*lead, -1)
    return h_BTD

  def core_step(
    self, h_BTD, x_BTD, with_probs: bool = False, segments_BT=None, pos_BT=None
  ):
    """One iteration of the shared core, with the input injected first;
    with_probs: also each layer's output and attention weights (`trace`)."""
    h_BTD = sharding.constrain(self.inject(h_BTD, x_BTD), ("batch", None, None))
    if with_probs:
      h_BTD, layers = _traced(self.core, h_BTD, segments_BT, pos_BT)
      return self.end_iteration(h_BTD), layers
    for block in self.core:
      h_BTD = block(h_BTD, segments_BT=segments_BT, pos_BT=pos_BT)
    return self.end_iteration(h_BTD)

  def end_iteration(self, h_BTD):
    """The state an iteration hands on: through the final norm where
    `state_norm` (Ouro normalizes the stream after every loop step)."""
    return self.norm(h_BTD) if self.cfg.state_norm else h_BTD

  def exit_logit(self, h_BTD):
    """Ouro's exit gate on an iteration's state: the logit of the probability
    of exiting there, given not earlier (..., B, T), float32."""
    w_D = self.gate_w.astype(h_BTD.dtype)
    return (h_BTD @ w_D).astype(jnp.float32) + self.gate_b

  def logits(self, h_D, norm: bool = True):
    """Final norm and unembedding of states with any leading axes: (..., V).
    The readout's last step, and the logit lens (applied to any layer's output);
    norm=False: states the final norm has already seen (`state_norm`)."""
    h_D = self.norm(h_D) if norm else h_D
    return (h_D @ self.unembedding.astype(h_D.dtype)).astype(jnp.float32)

  @property
  def unembedding(self):
    """The (D, V) readout matrix: the embedding's transpose where tied."""
    return self.embed.T if self.unembed is None else self.unembed

  def head(self, h_BTD):
    """The readout's two factors, (states (B, T, D), unembedding (D, V)), for
    a loss that makes the logits itself a chunk at a time (`loss.lm_sums`)."""
    return (self.norm(h_BTD) if self.readout_norm else h_BTD), self.unembedding

  def coda_in(self, h_BTD):
    """The state the coda starts from: the last iteration's, through the final
    norm where `coda_norm` (Huginn applies its final norm twice)."""
    return self.norm(h_BTD) if self.cfg.coda_norm else h_BTD

  def coda_out(self, h_BTD, segments_BT=None, pos_BT=None):
    """The state through the coda: what `logits` reads (B, T, D)."""
    return self._unlooped(self.coda, self.coda_in(h_BTD), segments_BT, pos_BT)

  def readout(self, h_BTD, answer_pos_B, segments_BT=None, pos_BT=None):
    """Coda, final norm and unembedding: logits at the answer position (B, V),
    or at every position (B, T, V) where `answer_pos_B` is None."""
    h_BTD = self.coda_out(h_BTD, segments_BT, pos_BT)
    if answer_pos_B is None:
      return self.logits(h_BTD, self.readout_norm)
    h_BD = jnp.take_along_axis(h_BTD, answer_pos_B[:, None, None], 1)[:, 0]
    return self.logits(h_BD, self.readout_norm)

  @property
  def readout_norm(self) -> bool:
    """Whether the readout applies the final norm: not to a last iteration's
    state that `state_norm` has normed (no coda after it: Ouro)."""
    return not (self.cfg.state_norm and not self.coda)

  def init_cache(self, batch: int, length: int, num_loops: int, dtype) -> dict:
    """Empty key/value caches for `decode`: per prelude and coda layer (B, S, N,
    H) each, per core layer (M, B, S, N, H) each, M = `num_loops`: every
    iteration its own, or fewer slots than the iterations run (bounded)."""
    N = self.cfg.num_heads
    shape = (batch, length, self.cfg.num_kv_heads or N, self.cfg.d_model // N)

    def kv(*lead):
      return tuple(jnp.zeros((*lead, *shape), dtype) for _ in range(2))

    return {
      "prelude": [kv() for _ in self.prelude],
      "core": [kv(num_loops) for _ in self.core],
      "coda": [kv() for _ in self.coda],
    }

  def decode(
    self, tokens_BT, cache: dict, offset, key=None, start_B=None, num_loops=None
  ):
    """Next-token logits (B, T, V) of tokens in slots offset.., given the
    caches of every earlier slot (`init_cache`); returns the caches with
    these tokens' keys and values written in. Prefill and one-token steps are
    the same call. `start_B`: each row's first real slot (prompts of
    different lengths, padded on the left). `num_loops` R: default, the
    caches' M slots, one per iteration (equal to the full forward's logits
    at those positions, a random initial state excepted: it is drawn per
    call); R > M: a bounded cache, iteration r reads and writes slot r mod M
    (Huginn's "compress-s" lookups)."""
    x_BTD, h_BTD, new = self.decode_in(tokens_BT, cache, offset, key, start_B)

    def iteration(h_BTD, core_cache, slot):
      return self.cached_step(h_BTD, x_BTD, core_cache, slot, offset, start_B)

    h_BTD, new["core"] = cached_iterations(iteration, h_BTD, cache["core"], num_loops)
    return self.decode_out(h_BTD, cache, offset, start_B, new)

  def decode_in(self, tokens_BT, cache, offset, key=None, start_B=None):
    """`decode`'s embedding and prelude: (x_BTD, the first state, the new
    caches so far)."""
    x_BTD = self.embed_tokens(tokens_BT, offset, start_B)
    new = {"prelude": [], "coda": []}
    for block, kv in zip(self.prelude, cache["prelude"], strict=True):
      x_BTD, kv = block.cached(x_BTD, kv, offset, start_B)
      new["prelude"].append(kv)
    return x_BTD, self.initial_state(x_BTD, key), new

  def cached_step(self, h_BTD, x_BTD, core_cache, slot, offset, start_B=None):
    """One iteration over the core's caches at `slot`: (the state it hands
    on, the caches)."""
    h_BTD = self.inject(h_BTD, x_BTD)
    out = []
    for block, kv in zip(self.core, core_cache, strict=True):
      h_BTD, kv = block.cached(h_BTD, kv, offset, start_B, slot)
      out.append(kv)
    return self.end_iteration(h_BTD), out

  def decode_out(self, h_BTD, cache, offset, start_B=None, new=None):
    """`decode`'s coda and readout from the last state: (logits (B, T, V),
    `new` with the coda's caches; None: only the logits, the caches as read)."""
    h_BTD = self.coda_in(h_BTD)
    coda = []
    for block, kv in zip(self.coda, cache["coda"], strict=True):
      h_BTD, kv = block.cached(h_BTD, kv, offset, start_B)
      coda.append(kv)
    logits_BTV = self.logits(h_BTD, self.readout_norm)
    if new is None:
      return logits_BTV
    return logits_BTV, {**new, "coda": coda}

  def trace(self, tokens_BT, num_loops: int, key=None, segments_BT=None) -> dict:
    """Every layer's output and attention weights, for the analyses.

    The same layers and the same `recurrence.unroll` as training: the core's
    per-layer values ride in the scanned state and come out as per-iteration
    readouts. Returns "embed" (B, T, D) and, for "prelude", "core" and "coda",
    {"hidden": (..., B, T, D), "attn": (..., B, N, T, S)} with leading axes
    (P,), (R, L) and (C,); the coda runs on the last iteration's state.
    Prelude or coda without layers: None.
    """
    x_BTD, pos_BT = self.embed_tokens(tokens_BT), self.positions(tokens_BT, key)
    out = {"embed": x_BTD}
    x_BTD, out["prelude"] = _traced(self.prelude, x_BTD, segments_BT, pos_BT)
    h_BTD = self.initial_state(x_BTD, key)
    (B, T, D), L, N = h_BTD.shape, len(self.core), self.cfg.num_heads
    layers0 = {  # the carry's shape before the first iteration
      "hidden": jnp.zeros((L, B, T, D), h_BTD.dtype),
      "attn": jnp.zeros((L, B, N, T, T), h_BTD.dtype),
    }
    (h_BTD, _), out["core"] = recurrence.unroll(
      lambda carry: self.core_step(carry[0], x_BTD, True, segments_BT, pos_BT),
      (h_BTD, layers0),
      num_loops,
      scan_unroll=self.cfg.scan_unroll,
      readout=lambda carry: carry[1],
    )
    _, out["coda"] = _traced(self.coda, self.coda_in(h_BTD), segments_BT, pos_BT)
    return out

  def __call__(
    self,
    tokens_BT,
    answer_pos_B,
    *,
    num_loops: int | None = None,
    per_iteration: bool = False,
    key=None,
    depth=None,
    grad_depth: int = 0,
    segments_BT=None,
    hidden: bool = False,
  ):
    """Logits (B, V) at the answer, or (B, T, V) for a language model; see
    `recurrence.unroll` for depth and grad_depth. `hidden` (a language model):
    the states after the coda instead (B, T, D), for a loss that applies
    `logits` a chunk at a time."""
    pos_BT = self.positions(tokens_BT, key)
    x_BTD, h_BTD = self.encode(tokens_BT, key, segments_BT, pos_BT)
    h_BTD, logits_RBV = recurrence.unroll(
      lambda h: self.core_step(h, x_BTD, segments_BT=segments_BT, pos_BT=pos_BT),
      h_BTD,
      num_loops or self.cfg.num_loops,
      remat=self.cfg.remat,
      scan_unroll=self.cfg.scan_unroll,
      readout=(lambda h: self.readout(h, answer_pos_B, segments_BT, pos_BT))
      if per_iteration
      else None,
      depth=depth,
      grad_depth=grad_depth,
      past_depth=self.cfg.past_depth,
    )
    if hidden:
      return self.coda_out(h_BTD, segments_BT, pos_BT)
    logits_BV = self.readout(h_BTD, answer_pos_B, segments_BT, pos_BT)
    return (logits_BV, logits_RBV) if per_iteration else logits_BV


def cached_iterations(iteration, carry, core_cache: list, num_loops=None):
  """`carry` through `num_loops` calls of iteration(carry, the core's caches,
  slot r mod M) -> (carry, the caches with slot r mod M written); M: the
  caches' leading axis, also the default number of iterations. The caches
  ride in the loop's carry, each iteration writing only its new entries.
  Returns (carry, the caches)."""
  M = core_cache[0][0].shape[0]

  def step(c, r):
    return iteration(*c, r % M), None

  out, _ = jax.lax.scan(step, (carry, core_cache), jnp.arange(num_loops or M))
  return out


def _traced(blocks, h_BTD, segments_BT=None, pos_BT=None):
  """h through `blocks`, and each block's output and attention weights stacked."""
  hidden, attn = [], []
  for block in blocks:
    h_BTD, probs_BNTS = block(h_BTD, True, segments_BT, pos_BT)
    hidden.append(h_BTD)
    attn.append(probs_BNTS)
  return h_BTD, (
    {"hidden": jnp.stack(hidden), "attn": jnp.stack(attn)} if hidden else None
  )
