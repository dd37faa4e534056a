"""The same looped transformer and train step in PyTorch (eager), for speed ratios.

Shapes, ops, optimizer (AdamW with decay on matrices, global-norm clipping) and
loss (answer-token cross-entropy with label smoothing) follow loopjax's model for
the options the benchmark configs use; other options raise. Needs the `bench`
extra (torch).
"""

import torch
import torch.nn.functional as F
from torch import nn


def _unsupported(cfg):
  wanted = dict(
    pos_encoding="learned",
    norm_position="pre",
    norm_type="layernorm",
    init_state="embedding",
    num_prelude=0,
    num_coda=0,
    dtype="float32",
  )
  for k, v in wanted.items():
    if cfg[k] != v:
      return f"model.{k}={cfg[k]!r} (the PyTorch reference supports {v!r})"
  if cfg.injection not in ("none", "add"):
    return f"model.injection={cfg.injection!r} (supported: none, add)"
  return None


class Block(nn.Module):
  def __init__(self, d: int, heads: int, mlp_ratio: int):
    super().__init__()
    self.heads = heads
    self.norm1, self.norm2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
    self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
    self.fc1, self.fc2 = nn.Linear(d, mlp_ratio * d), nn.Linear(mlp_ratio * d, d)

  def forward(self, x_BTD):
    B, T, D = x_BTD.shape
    qkv = self.qkv(self.norm1(x_BTD)).view(B, T, 3, self.heads, D // self.heads)
    q_BNTH, k_BNTH, v_BNTH = qkv.permute(2, 0, 3, 1, 4)
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
    self.pos = nn.Parameter(torch.randn(max_len, d) * cfg.init_std)
    self.core = nn.ModuleList(
      Block(d, cfg.num_heads, cfg.mlp_ratio) for _ in range(cfg.num_layers)
    )
    self.norm = nn.LayerNorm(d, eps=1e-5)
    self.unembed = None if cfg.tie_embeddings else nn.Linear(d, vocab_size, bias=False)

  def forward(self, tokens_BT, answer_pos_B):
    x_BTD = self.embed[tokens_BT] + self.pos[: tokens_BT.shape[1]]
    h_BTD = x_BTD
    for _ in range(self.cfg.num_loops):
      if self.cfg.injection == "add":
        h_BTD = h_BTD + x_BTD
      for block in self.core:
        h_BTD = block(h_BTD)
    h_BD = self.norm(h_BTD[torch.arange(h_BTD.shape[0]), answer_pos_B])
    return h_BD @ self.embed.T if self.unembed is None else self.unembed(h_BD)


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
