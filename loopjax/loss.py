"""Training losses. The knowledge-graph tasks: cross-entropy on the answer
token (softmax's or StableMax's, `train.xent`), after the iterations
`train.supervise` names. A language model: next-token cross-entropy over
every real target (`lm_loss_fn`)."""

import functools

import jax
import jax.numpy as jnp
import optax


def supervised(mode: str, R: int, hops_B, depth=None):
  """Which iterations' answers get a loss: bool (R, B), True where supervised;
  with a sampled `depth` (traced), iterations past it never are and the last
  is `depth`.

  "last": the answer after the final iteration only (the papers).
  "atomic_every": atomic facts (1 hop) after every iteration, the rest after
  the last: a fact must be retrievable at whatever iteration a composition
  needs it, not only at R (without it, OOD facts, never used as a first hop in
  training, resolve iterations later than ID ones: docs/results/sysgen.md).
  "from_hops": every iteration from the example's hop count on (and the last).
  """
  t_R1, hops_1B = jnp.arange(1, R + 1)[:, None], hops_B[None]
  last = R if depth is None else depth
  if mode == "last":
    on_RB = jnp.broadcast_to(t_R1 == last, (R, hops_B.shape[0]))
  elif mode == "atomic_every":
    on_RB = (t_R1 == last) | (hops_1B == 1)
  else:
    on_RB = (t_R1 >= hops_1B) | (t_R1 == last)
  return on_RB & (t_R1 <= last)


def log_stablemax(logits_NV):
  """log of StableMax (Prieto et al. 2025): s(x) = x + 1 for x >= 0 and
  1 / (1 - x) below, normalized. It grows linearly, so a correct answer's
  loss cannot be driven to float32's floor by scaling the logits (softmax
  collapse); computed in float32."""
  x = logits_NV.astype(jnp.float32)
  s = jnp.where(x >= 0, x + 1, 1 / (1 - jnp.minimum(x, 0)))
  return jnp.log(s) - jnp.log(s.sum(-1, keepdims=True))


def answer_xent(logits_NV, target_N, label_smoothing: float, xent: str = "softmax"):
  """Per-example cross-entropy on the answer token; any leading shape N;
  `xent`: the normalization, "softmax" or "stablemax"."""
  V = logits_NV.shape[-1]
  labels_NV = optax.smooth_labels(jax.nn.one_hot(target_N, V), label_smoothing)
  if xent == "stablemax":
    return -(labels_NV * log_stablemax(logits_NV)).sum(-1)
  return optax.softmax_cross_entropy(logits_NV, labels_NV)


def answer_loss(logits_BV, target_B, label_smoothing: float, xent: str = "softmax"):
  """Mean cross-entropy on the answer token (with label smoothing), accuracy."""
  loss_B = answer_xent(logits_BV, target_B, label_smoothing, xent)
  return loss_B.mean(), (logits_BV.argmax(-1) == target_B).mean()


def loss_fn(model, batch, train_cfg, *, key, num_loops: int, depth=None):
  """(loss, accuracy) of `model` (an nnx module) on a batch. `depth`: a sampled
  depth (traced) within a scan of `num_loops` iterations."""
  run = lambda **kw: model(  # noqa: E731
    batch["inputs"],
    batch["answer_pos"],
    key=key,
    num_loops=num_loops,
    depth=depth,
    grad_depth=train_cfg.backprop_depth,
    **kw,
  )
  ls, xent = train_cfg.label_smoothing, train_cfg.xent
  if train_cfg.supervise == "last":
    return answer_loss(run(), batch["target"], ls, xent)
  logits_BV, logits_RBV = run(per_iteration=True)
  on_RB = supervised(train_cfg.supervise, num_loops, batch["hops"], depth)
  loss_RB = answer_xent(logits_RBV, batch["target"][None], ls, xent)
  loss = (loss_RB * on_RB).sum() / on_RB.sum()
  return loss, (logits_BV.argmax(-1) == batch["target"]).mean()


def _xent_terms(logits_MV, targets_M, z_loss: float):
  """Per position (M,): loss (+ z-loss), correct, and what the gradient needs:
  the max-shifted exponentials (M, V), their sum and the logsumexp."""
  max_M = logits_MV.max(-1)
  exp_MV = jnp.exp(logits_MV - max_M[:, None])
  sum_M = exp_MV.sum(-1)
  lse_M = max_M + jnp.log(sum_M)
  true_M = jnp.take_along_axis(logits_MV, targets_M[:, None], -1)[:, 0]
  loss_M = lse_M - true_M + z_loss * lse_M**2
  # The target's logit is the largest (argmax == target but for exact ties):
  # a max, not XLA:CPU's index-tracking argmax reduce (7% of the cpu step).
  return loss_M, true_M >= max_M, (exp_MV, sum_M, lse_M)


def lm_xent(logits_BTV, targets_BT, mask_BT, z_loss: float = 0.0):
  """(summed masked cross-entropy (+ z-loss), summed correct, mask total).

  z-loss (PaLM): z * logsumexp(logits)^2 keeps the softmax normalizer near 1,
  which bf16 logits of large vocabularies need to stay stable."""
  V = logits_BTV.shape[-1]
  loss_M, correct_M, _ = _xent_terms(
    logits_BTV.astype(jnp.float32).reshape(-1, V), targets_BT.reshape(-1), z_loss
  )
  m_M = mask_BT.reshape(-1)
  return (loss_M * m_M).sum(), (correct_M * m_M).sum(), mask_BT.sum()


# Positions per chunk of the LM loss: the (B, chunk, V) logits of one chunk
# exist at a time. Memory: at vocabulary 32k and 64 x 1024 tokens the whole
# float32 logits would be 8.6 GB; speed: on CPU the chunks stay in cache.
LM_LOSS_CHUNK = 64


def chunk_size(T: int) -> int:
  """The largest divisor of T up to LM_LOSS_CHUNK."""
  return max(c for c in range(1, min(T, LM_LOSS_CHUNK) + 1) if T % c == 0)


def _chunked(a_BT):
  """(B, T, ...) -> (C, B, T / C, ...): chunks of positions, every row in each
  (a batch split over devices stays split)."""
  B, T = a_BT.shape[:2]
  C = T // chunk_size(T)
  return jnp.swapaxes(a_BT.reshape(B, C, T // C, *a_BT.shape[2:]), 0, 1)


def _unchunked(a_CBt):
  a_BCt = jnp.swapaxes(a_CBt, 0, 1)
  return a_BCt.reshape(a_BCt.shape[0], -1, *a_BCt.shape[3:])


def lm_row_sums(logits_fn, h_BTD, targets_BT, mask_BT, z_loss: float = 0.0):
  """Per sequence (B,): summed loss, correct and target counts, the logits
  `logits_fn(h)` made a chunk of positions at a time, so no (B, T, V) array
  ever exists. For evaluation; training differentiates `lm_sums`."""

  def chunk(h_BtD, t_Bt, m_Bt):
    per_row = jax.vmap(lambda lg, t, m: lm_xent(lg[None], t[None], m[None], z_loss))
    return per_row(logits_fn(h_BtD), t_Bt, m_Bt)

  sums_C3B = jax.lax.map(
    lambda a: chunk(*a), tuple(map(_chunked, (h_BTD, targets_BT, mask_BT)))
  )
  return jax.tree.map(lambda a: a.sum(0), sums_C3B)


def _lm_sums(x_BTD, w_DV, targets_BT, mask_BT, z_loss: float, grads: bool):
  """`lm_sums`, and with `grads` the gradient of its loss with respect to x
  and w, made in the same pass over the chunks."""
  (D, V), w_dtype = w_DV.shape, w_DV.dtype
  w_DV = w_DV.astype(x_BTD.dtype)

  def chunk(dw_DV, xs):
    x_BtD, t_Bt, m_Bt = xs
    x_MD, m_M = x_BtD.reshape(-1, D), m_Bt.reshape(-1)
    logits_MV = (x_MD @ w_DV).astype(jnp.float32)
    loss_M, correct_M, (exp_MV, sum_M, lse_M) = _xent_terms(
      logits_MV, t_Bt.reshape(-1), z_loss
    )
    sums = ((loss_M * m_M).sum(), (correct_M * m_M).sum())
    if not grads:
      return dw_DV, sums
    # d loss / d logits: the softmax (times the z-loss's 1 + 2 z lse) less
    # the target's one-hot, at the real targets.
    p_MV = exp_MV * ((1 + 2 * z_loss * lse_M) / sum_M)[:, None]
    hot_MV = t_Bt.reshape(-1, 1) == jnp.arange(V)[None]
    dlogits_MV = ((p_MV - hot_MV) * m_M[:, None]).astype(x_MD.dtype)
    dw_DV = dw_DV + (x_MD.T @ dlogits_MV).astype(jnp.float32)
    return dw_DV, (*sums, (dlogits_MV @ w_DV.T).reshape(x_BtD.shape))

  dw_DV, out = jax.lax.scan(
    chunk,
    jnp.zeros((D, V), jnp.float32),
    tuple(map(_chunked, (x_BTD, targets_BT, mask_BT))),
  )
  sums = (out[0].sum(), out[1].sum(), mask_BT.sum())
  return (sums, (_unchunked(out[2]), dw_DV.astype(w_dtype))) if grads else sums


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def lm_sums(x_BTD, w_DV, targets_BT, mask_BT, z_loss: float = 0.0):
  """(summed loss, summed correct, mask total) of the logits x @ w, float32.

  A fused linear cross-entropy (as Liger's kernel and Apple's Cut
  Cross-Entropy): the logits exist a chunk of positions at a time, and the
  forward pass makes the loss's gradient with respect to x and w beside the
  loss, so the backward pass only scales it, neither recomputing the logits
  nor storing them. Only the summed loss is differentiable (the counts' are
  zero). The `cpu` shape's loss, forward and backward: 180 -> 55 ms on CPU
  (docs/performance.md)."""
  return _lm_sums(x_BTD, w_DV, targets_BT, mask_BT, z_loss, grads=False)


def _lm_sums_fwd(x_BTD, w_DV, targets_BT, mask_BT, z_loss):
  return _lm_sums(x_BTD, w_DV, targets_BT, mask_BT, z_loss, grads=True)


def _lm_sums_bwd(z_loss, grads, g):
  dx_BTD, dw_DV = grads
  return (
    (g[0] * dx_BTD).astype(dx_BTD.dtype),
    (g[0] * dw_DV).astype(dw_DV.dtype),
    None,
    None,
  )


lm_sums.defvjp(_lm_sums_fwd, _lm_sums_bwd)


def lm_loss_fn(model, batch, train_cfg, *, key, num_loops: int, depth=None):
  """(mean next-token loss, next-token accuracy) over the batch's real targets."""
  h_BTD = model(
    batch["inputs"],
    None,
    key=key,
    num_loops=num_loops,
    depth=depth,
    grad_depth=train_cfg.backprop_depth,
    segments_BT=batch["segments"],
    hidden=True,
  )
  total, correct, n = lm_sums(
    *model.head(h_BTD), batch["targets"], batch["mask"], train_cfg.z_loss
  )
  n = jnp.maximum(n, 1.0)
  return total / n, correct / n
