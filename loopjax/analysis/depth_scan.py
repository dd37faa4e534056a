"""A language model's recurrence run once, every layer's statistics reduced as
it goes, so memory does not grow with the number of iterations.

`LoopedTransformer.trace` stacks every layer's output and attention weights,
(R, L, B, N, T, T) of them: at 512 tokens and R = 32 that is gigabytes. Here a
`lax.scan` over iterations calls the model's own pieces (`inject`, the core
blocks with their weights, `end_iteration`, `logits`) and keeps, besides the
state, what the next iteration's statistics compare against: the previous
iteration's layer outputs, their reads and updates, the reads P iterations
back and the previous iteration's attention weights. Each iteration emits only
per-sequence and per-token scalars (`stages.layer_stats`, `stages.head_stats`,
`fixed_points.step_metrics`), so the peak holds two iterations' attention
weights, whatever R is (`memory` measures it).
"""

import jax
import jax.numpy as jnp

from loopjax.analysis import fixed_points, stages


def _group(blocks, h_BTD, batch, first_BT, logits_fn):
  """h through `blocks` with each block's layer and head statistics stacked
  (None for a group without blocks)."""
  stats, heads = [], []
  for block in blocks:
    h_BTD, probs = block(h_BTD, with_probs=True, segments_BT=batch["segments"])
    stats.append(stages.layer_stats(h_BTD, batch, first_BT, logits_fn))
    heads.append(stages.head_stats(probs, batch["real"], first_BT)[0])
  stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs) if xs else None  # noqa: E731
  return h_BTD, stack(stats), stack(heads)


def run(model, batch, num_loops: int, key=None) -> dict:
  """Per sequence, batch axis first: "embed", "prelude"/"coda" (B, P, ...),
  "core" (B, R, L, ...) layer statistics with their heads' ("*_heads"),
  "fixed_points" (`fixed_points.from_stream`'s layout) and "attention":
  sink, top_share, entropy (B, R, L, N), stability (B, R-1, L, N) and the last
  iteration's column sums, profile (B, 1, L, N, S) (the
  KG trace's layout with one iteration)."""
  m, seg = model, batch["segments"]
  first_BT = stages.first_tokens(seg)
  real_BT = batch["real"]
  x_BTD = m.embed_tokens(batch["inputs"])
  out = {"embed": stages.layer_stats(x_BTD, batch, first_BT, m.logits)}
  x_BTD, out["prelude"], out["prelude_heads"] = _group(
    m.prelude, x_BTD, batch, first_BT, m.logits
  )
  h_BTD = m.initial_state(x_BTD, key)
  read = fixed_points.next_layer_reads(m, x_BTD)
  (B, T, D), L, N = h_BTD.shape, len(m.core), m.cfg.num_heads
  P = min(fixed_points.MAX_PERIOD, num_loops - 1)
  f32 = jnp.float32
  prev0 = {
    "h": jnp.zeros((L, B, T, D), f32),
    "read": jnp.zeros((L, B, T, D), f32),
    "delta": jnp.zeros((L, B, T, D), f32),
    "ring": jnp.zeros((max(P, 1), L, B, T, D), f32),
    "probs": jnp.zeros((L, B, N, T, T), f32),
    "profile": jnp.zeros((L, B, N, T), f32),
  }

  def iteration(carry, _):
    h_BTD, prev = carry
    h_BTD = m.inject(h_BTD, x_BTD)
    hs, probs, layer, heads, profiles = [], [], [], [], []
    for block in m.core:
      h_BTD, p_BNTS = block(h_BTD, with_probs=True, segments_BT=seg)
      hs.append(h_BTD.astype(f32))
      probs.append(p_BNTS.astype(f32))
      layer.append(stages.layer_stats(h_BTD, batch, first_BT, m.logits))
      head, p_BNS = stages.head_stats(p_BNTS, real_BT, first_BT)
      heads.append(head)
      profiles.append(p_BNS)
    h_BTD = m.end_iteration(h_BTD)
    h_L, probs_L = jnp.stack(hs), jnp.stack(probs)
    read_L = read(h_L)
    curves, delta = fixed_points.step_metrics(
      prev["h"], h_L, prev["read"], read_L, prev["delta"]
    )
    tv_LBNT = 0.5 * jnp.abs(probs_L - prev["probs"]).sum(-1)
    queries = real_BT.astype(f32)[None, :, None]
    stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)  # noqa: E731
    ys = {
      "layer": stack(layer),
      "heads": stack(heads),
      "curves": curves,
      "stability": (tv_LBNT * queries).sum(-1) / queries.sum(-1),
    }
    ring = jnp.concatenate([prev["read"][None], prev["ring"][:-1]])
    new = {
      "h": h_L,
      "read": read_L,
      "delta": delta,
      "ring": ring,
      "probs": probs_L,
      "profile": jnp.stack(profiles),
    }
    return (h_BTD, new), ys

  (h_BTD, last), ys = jax.lax.scan(iteration, (h_BTD, prev0), None, length=num_loops)
  _, out["coda"], out["coda_heads"] = _group(m.coda, h_BTD, batch, first_BT, m.logits)
  first = lambda tree, axis: jax.tree.map(lambda a: jnp.moveaxis(a, axis, 0), tree)  # noqa: E731
  for k in ("prelude", "prelude_heads", "coda", "coda_heads"):  # (P, B, ...)
    out[k] = first(out[k], 1)
  out["core"], out["core_heads"] = first(ys["layer"], 2), first(ys["heads"], 2)
  curves = dict(ys["curves"])  # (R, L, B, T): entry r compares iterations r, r + 1
  curves = {k: v[1:] for k, v in curves.items()} | {"update": curves["update"][2:]}
  limits = fixed_points.limit_metrics(last["h"], last["ring"][:P], last["read"])
  out["fixed_points"] = fixed_points.tokens_first(curves | limits) | {"real": real_BT}
  out["attention"] = first(
    {k: ys["heads"][k] for k in ("sink", "top_share", "entropy")}
    | {"stability": ys["stability"][1:]},
    2,
  ) | {"profile": first(last["profile"], 1)[:, None]}
  return out
