"""Training losses. The knowledge-graph tasks: cross-entropy on the answer
token, after the iterations `train.supervise` names. A language model:
next-token cross-entropy over every real target (`lm_loss_fn`)."""

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


def answer_xent(logits_NV, target_N, label_smoothing: float):
  """Per-example cross-entropy on the answer token; any leading shape N."""
  V = logits_NV.shape[-1]
  labels_NV = optax.smooth_labels(jax.nn.one_hot(target_N, V), label_smoothing)
  return optax.softmax_cross_entropy(logits_NV, labels_NV)


def answer_loss(logits_BV, target_B, label_smoothing: float):
  """Mean cross-entropy on the answer token (with label smoothing), accuracy."""
  loss_B = answer_xent(logits_BV, target_B, label_smoothing)
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
  ls = train_cfg.label_smoothing
  if train_cfg.supervise == "last":
    return answer_loss(run(), batch["target"], ls)
  logits_BV, logits_RBV = run(per_iteration=True)
  # The answer sits after h r1..rk at position k: k hops.
  on_RB = supervised(train_cfg.supervise, num_loops, batch["answer_pos"], depth)
  loss_RB = answer_xent(logits_RBV, batch["target"][None], ls)
  loss = (loss_RB * on_RB).sum() / on_RB.sum()
  return loss, (logits_BV.argmax(-1) == batch["target"]).mean()


def lm_xent(logits_BTV, targets_BT, mask_BT, z_loss: float = 0.0):
  """(summed masked cross-entropy (+ z-loss), summed correct, mask total).

  z-loss (PaLM): z * logsumexp(logits)^2 keeps the softmax normalizer near 1,
  which bf16 logits of large vocabularies need to stay stable."""
  logits_BTV = logits_BTV.astype(jnp.float32)
  lse_BT = jax.nn.logsumexp(logits_BTV, -1)
  true_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], -1)[..., 0]
  loss_BT = lse_BT - true_BT + z_loss * lse_BT**2
  # The target's logit is the largest (argmax == target but for exact ties):
  # a max, not XLA:CPU's index-tracking argmax reduce (7% of the cpu step).
  correct_BT = true_BT >= logits_BTV.max(-1)
  return (loss_BT * mask_BT).sum(), (correct_BT * mask_BT).sum(), mask_BT.sum()


# Positions per chunk of the LM loss: the (B, chunk, V) logits of one chunk
# exist at a time, recomputed in the backward pass. Memory: at vocabulary 32k
# and 64 x 1024 tokens the whole float32 logits would be 8.6 GB; speed: on
# CPU the chunks stay in cache (the `cpu` shape's step ~8% faster than one
# chunk, docs/performance.md).
LM_LOSS_CHUNK = 64


def chunk_size(T: int) -> int:
  """The largest divisor of T up to LM_LOSS_CHUNK."""
  return max(c for c in range(1, min(T, LM_LOSS_CHUNK) + 1) if T % c == 0)


def lm_row_sums(logits_fn, h_BTD, targets_BT, mask_BT, z_loss: float = 0.0):
  """Per sequence (B,): summed loss, correct and target counts, the logits
  `logits_fn(h)` made a chunk of positions at a time (recomputed in the
  backward pass), so no (B, T, V) array ever exists."""
  B, T, _ = h_BTD.shape
  C = T // chunk_size(T)

  def chunks(a):
    return jnp.swapaxes(a.reshape(B, C, T // C, *a.shape[2:]), 0, 1)

  @jax.checkpoint
  def chunk(h_BtD, t_Bt, m_Bt):
    per_row = jax.vmap(lambda lg, t, m: lm_xent(lg[None], t[None], m[None], z_loss))
    return per_row(logits_fn(h_BtD), t_Bt, m_Bt)

  sums_C3B = jax.lax.map(
    lambda a: chunk(*a), (chunks(h_BTD), chunks(targets_BT), chunks(mask_BT))
  )
  return jax.tree.map(lambda a: a.sum(0), sums_C3B)


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
  total, correct, n = (
    a.sum()
    for a in lm_row_sums(
      model.logits, h_BTD, batch["targets"], batch["mask"], train_cfg.z_loss
    )
  )
  n = jnp.maximum(n, 1.0)
  return total / n, correct / n
