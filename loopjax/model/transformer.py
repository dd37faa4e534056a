"""LoopedTransformer: embed -> prelude -> core^R -> coda -> norm -> unembed."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from loopjax import recurrence, sharding
from loopjax.model.layers import Block, Norm, param, zeros


def sinusoidal(max_len: int, d: int) -> np.ndarray:
  pos_T1 = np.arange(max_len)[:, None]
  freq_H = np.exp(-np.log(10_000.0) * np.arange(0, d, 2) / d)
  pe_TD = np.zeros((max_len, d), np.float32)
  pe_TD[:, 0::2] = np.sin(pos_T1 * freq_H)
  pe_TD[:, 1::2] = np.cos(pos_T1 * freq_H[: d // 2])
  return pe_TD


class LoopedTransformer(nnx.Module):
  """A block of L layers whose weights are shared across R iterations.

  `cfg` is the `model` section of the config. The answer is read at
  `answer_pos_B` (the last real token); with `per_iteration=True` the call
  also returns the answer logits after each iteration, shape (R, B, V).
  """

  def __init__(self, cfg, vocab_size: int, max_len: int, *, rngs: nnx.Rngs):
    self.cfg = cfg
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
    self.norm = Norm(d, cfg.norm_type, rngs=rngs)
    self.unembed = (
      None
      if cfg.tie_embeddings
      else param(rngs, normal, (d, vocab_size), ("embed", "vocab"))
    )

  def embed_tokens(self, tokens_BT):
    x_BTD = self.embed[tokens_BT]
    T, D = x_BTD.shape[1:]
    if self.cfg.pos_encoding == "learned":
      x_BTD = x_BTD + self.pos[None, :T]
    elif self.cfg.pos_encoding == "sinusoidal":
      x_BTD = x_BTD + sinusoidal(T, D)[None]
    return x_BTD

  def initial_state(self, x_BTD, key):
    if self.cfg.init_state == "embedding":
      return x_BTD
    if self.cfg.init_state == "zeros":
      return jnp.zeros_like(x_BTD)
    return jax.random.normal(key, x_BTD.shape, x_BTD.dtype)  # Huginn-style

  def encode(self, tokens_BT, key=None):
    """(x_BTD, h_BTD): the input the core sees each iteration, and its first state."""
    x_BTD = self.embed_tokens(tokens_BT)
    for block in self.prelude:
      x_BTD = block(x_BTD)
    return x_BTD, self.initial_state(x_BTD, key)

  def inject(self, h_BTD, x_BTD):
    """The state an iteration starts from: the input injected into it."""
    if self.cfg.injection == "add":
      return h_BTD + x_BTD
    if self.cfg.injection == "concat":
      return (
        jnp.concatenate([h_BTD, x_BTD], -1) @ self.adapter + self.adapter_b[None, None]
      )
    return h_BTD

  def core_step(self, h_BTD, x_BTD, with_probs: bool = False):
    """One iteration of the shared core, with the input injected first;
    with_probs: also each layer's output and attention weights (`trace`)."""
    h_BTD = sharding.constrain(self.inject(h_BTD, x_BTD), ("batch", None, None))
    if with_probs:
      return _traced(self.core, h_BTD)
    for block in self.core:
      h_BTD = block(h_BTD)
    return h_BTD

  def logits(self, h_D):
    """Final norm and unembedding of states with any leading axes: (..., V).
    The readout's last step, and the logit lens (applied to any layer's output)."""
    h_D = self.norm(h_D)
    w_DV = self.embed.T if self.unembed is None else self.unembed
    return (h_D @ w_DV.astype(h_D.dtype)).astype(jnp.float32)

  def readout(self, h_BTD, answer_pos_B):
    """Coda, final norm and unembedding at the answer position: logits (B, V)."""
    for block in self.coda:
      h_BTD = block(h_BTD)
    return self.logits(jnp.take_along_axis(h_BTD, answer_pos_B[:, None, None], 1)[:, 0])

  def trace(self, tokens_BT, num_loops: int, key=None) -> dict:
    """Every layer's output and attention weights, for the analyses.

    The same layers and the same `recurrence.unroll` as training: the core's
    per-layer values ride in the scanned state and come out as per-iteration
    readouts. Returns "embed" (B, T, D) and, for "prelude", "core" and "coda",
    {"hidden": (..., B, T, D), "attn": (..., B, N, T, S)} with leading axes
    (P,), (R, L) and (C,); the coda runs on the last iteration's state.
    Prelude or coda without layers: None.
    """
    x_BTD = self.embed_tokens(tokens_BT)
    out = {"embed": x_BTD}
    x_BTD, out["prelude"] = _traced(self.prelude, x_BTD)
    h_BTD = self.initial_state(x_BTD, key)
    (B, T, D), L, N = h_BTD.shape, len(self.core), self.cfg.num_heads
    layers0 = {  # the carry's shape before the first iteration
      "hidden": jnp.zeros((L, B, T, D), h_BTD.dtype),
      "attn": jnp.zeros((L, B, N, T, T), h_BTD.dtype),
    }
    (h_BTD, _), out["core"] = recurrence.unroll(
      lambda carry: self.core_step(carry[0], x_BTD, with_probs=True),
      (h_BTD, layers0),
      num_loops,
      scan_unroll=self.cfg.scan_unroll,
      readout=lambda carry: carry[1],
    )
    _, out["coda"] = _traced(self.coda, h_BTD)
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
  ):
    """Answer logits (B, V); see `recurrence.unroll` for depth and grad_depth."""
    x_BTD, h_BTD = self.encode(tokens_BT, key)
    h_BTD, logits_RBV = recurrence.unroll(
      lambda h: self.core_step(h, x_BTD),
      h_BTD,
      num_loops or self.cfg.num_loops,
      remat=self.cfg.remat,
      scan_unroll=self.cfg.scan_unroll,
      readout=(lambda h: self.readout(h, answer_pos_B)) if per_iteration else None,
      depth=depth,
      grad_depth=grad_depth,
    )
    logits_BV = self.readout(h_BTD, answer_pos_B)
    return (logits_BV, logits_RBV) if per_iteration else logits_BV


def _traced(blocks, h_BTD):
  """h through `blocks`, and each block's output and attention weights stacked."""
  hidden, attn = [], []
  for block in blocks:
    h_BTD, probs_BNTS = block(h_BTD, with_probs=True)
    hidden.append(h_BTD)
    attn.append(probs_BNTS)
  return h_BTD, (
    {"hidden": jnp.stack(hidden), "attn": jnp.stack(attn)} if hidden else None
  )
