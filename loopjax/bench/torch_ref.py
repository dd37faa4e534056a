"""The same looped transformer and train step in PyTorch (eager), for speed ratios.

Shapes, ops, optimizer (AdamW with decay on matrices, global-norm clipping) and
loss (answer-token cross-entropy with label smoothing; for a language model,
next-token cross-entropy over the masked targets) follow loopjax's model for
the options the benchmark configs use; other options raise. Needs the `bench`
extra (torch).
"""

import torch
import torch.nn.functional as F
from torch import nn


def _unsupported(cfg):
  wanted = dict(
    norm_position="pre",
    init_state="embedding",
    mlp_type="gelu",
    num_kv_heads=0,
    rope_pairing="half",
    embed_scale=1.0,
    state_norm=False,
    num_prelude=0,
    num_coda=0,
    dtype="float32",
  )
  for k, v in wanted.items():
    if cfg[k] != v:
      return f"model.{k}={cfg[k]!r} (the PyTorch reference supports {v!r})"
  for k, allowed in dict(
    injection=("none", "add"), pos_encoding=("learned", "rope")
  ).items():
    if cfg[k] not in allowed:
      return f"model.{k}={cfg[k]!r} (supported: {', '.join(allowed)})"
  return None


def _norm(cfg, d: int):
  if cfg.norm_type == "rmsnorm":
    return nn.RMSNorm(d, eps=cfg.norm_eps)
  return nn.LayerNorm(d, eps=cfg.norm_eps)


def _rope(x_BNTH, base: float):
  """Half-split pairs (i, i + H/2), as loopjax's default."""
  T, H = x_BNTH.shape[2], x_BNTH.shape[3]
  freq = base ** (-torch.arange(0, H, 2, dtype=torch.float32) / H)
  angle_TF = torch.arange(T, dtype=torch.float32)[:, None] * freq[None]
  cos, sin = angle_TF.cos(), angle_TF.sin()
  x1, x2 = x_BNTH[..., : H // 2], x_BNTH[..., H // 2 :]
  return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Block(nn.Module):
  def __init__(self, cfg):
    super().__init__()
    d, hidden = cfg.d_model, cfg.mlp_hidden or cfg.mlp_ratio * cfg.d_model
    self.heads, self.cfg = cfg.num_heads, cfg
    self.norm1, self.norm2 = _norm(cfg, d), _norm(cfg, d)
    self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
    self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

  def forward(self, x_BTD):
    B, T, D = x_BTD.shape
    qkv = self.qkv(self.norm1(x_BTD)).view(B, T, 3, self.heads, D // self.heads)
    q_BNTH, k_BNTH, v_BNTH = qkv.permute(2, 0, 3, 1, 4)
    if self.cfg.pos_encoding == "rope":
      q_BNTH, k_BNTH = (_rope(a, self.cfg.rope_theta) for a in (q_BNTH, k_BNTH))
    a_BNTH = F.scaled_dot_product_attention(q_BNTH, k_BNTH, v_BNTH, is_causal=True)
    x_BTD = x_BTD + self.out(a_BNTH.transpose(1, 2).reshape(B, T, D))
    return x_BTD + self.fc2(F.gelu(self.fc1(self.norm2(x_BTD)), approximate="tanh"))


class LoopedTransformer(nn.Module):
  def __init__(self, cfg, vocab_size: int, max_len: int):
    super().__init__()
    if reason := _unsupported(cfg):
      raise ValueError(reason)
    self.cfg = cfg
    d = cfg.d_model
    self.embed = nn.Parameter(torch.randn(vocab_size, d) * cfg.init_std)
    learned = cfg.pos_encoding == "learned"
    self.pos = nn.Parameter(torch.randn(max_len, d) * cfg.init_std) if learned else None
    self.core = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
    self.norm = _norm(cfg, d)
    self.unembed = None if cfg.tie_embeddings else nn.Linear(d, vocab_size, bias=False)

  def forward(self, tokens_BT, answer_pos_B=None):
    """Answer logits (B, V), or logits at every position (B, T, V) if None."""
    x_BTD = self.embed[tokens_BT]
    if self.pos is not None:
      x_BTD = x_BTD + self.pos[: tokens_BT.shape[1]]
    h_BTD = x_BTD
    for _ in range(self.cfg.num_loops):
      if self.cfg.injection == "add":
        h_BTD = h_BTD + x_BTD
      for block in self.core:
        h_BTD = block(h_BTD)
    if answer_pos_B is not None:
      h_BTD = h_BTD[torch.arange(h_BTD.shape[0]), answer_pos_B]
    h = self.norm(h_BTD)
    return h @ self.embed.T if self.unembed is None else self.unembed(h)


def make_train_step(config, vocab_size: int, max_len: int):
  """Returns step(batch) -> loss, over a fresh model and AdamW optimizer."""
  torch.manual_seed(config.seed)
  model = LoopedTransformer(config.model, vocab_size, max_len)
  tc = config.train
  params = list(model.parameters())
  opt = torch.optim.AdamW(
    [
      {"params": [p for p in params if p.ndim >= 2], "weight_decay": tc.weight_decay},
      {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ],
    lr=tc.lr,
    betas=(tc.b1, tc.b2),
    eps=1e-8,
  )

  def step(batch):
    opt.zero_grad(set_to_none=True)
    if "targets" in batch:  # a language model: every masked target
      logits_BTV = model(batch["inputs"])
      xent_BT = F.cross_entropy(
        logits_BTV.flatten(0, 1), batch["targets"].flatten(), reduction="none"
      )
      mask = batch["mask"].flatten().float()
      loss = (xent_BT * mask).sum() / mask.sum()
    else:
      logits_BV = model(batch["inputs"], batch["answer_pos"])
      loss = F.cross_entropy(
        logits_BV, batch["target"], label_smoothing=tc.label_smoothing
      )
    loss.backward()
    if tc.grad_clip > 0:
      torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
    opt.step()
    return loss

  return step


def to_torch(batch: dict) -> dict:
  return {k: torch.as_tensor(v).long() for k, v in batch.items()}
