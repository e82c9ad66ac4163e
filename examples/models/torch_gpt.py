"""The tiny GPT of the DeepSpeed fixtures (``tools/train_ds.py``), in torch.

Same modules, parameter names, seeds, batches and AdamW parameter groups as
the fixture trainer, so a run can be continued and compared across
frameworks::

    torch.manual_seed(1234)
    model = TinyGPT()
    x, y = make_batch(step)          # the global batch of ``step`` (8 x 16 tokens)
    loss = model(x, y)
    opt = torch.optim.AdamW(param_groups(model), lr=LR, betas=BETAS, eps=EPS)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 101  # deliberately odd
D = 60  # not a multiple of 8
CTX = 16
N_LAYER = 3
N_HEAD = 4
GLOBAL_BATCH = 8
# the optimizer of the DeepSpeed fixtures: AdamW, clip 1.0, weight decay 0.1 on matrices only
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-2, (0.9, 0.95), 1e-8, 0.1, 1.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 4 * D)
        self.fc_out = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q = q.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        k = k.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        v = v.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(CTX, D)
        self.blocks = nn.ModuleList([Block() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=True)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)[None]
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: inputs and next-token targets, ``[GLOBAL_BATCH, CTX]`` each."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, CTX + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def decays(name: str, ndim: int) -> bool:
    """Whether AdamW decays this parameter: matrices except the embeddings."""
    return ndim >= 2 and "wte" not in name and "wpe" not in name


def param_groups(model: nn.Module) -> list[dict]:
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if decays(n, p.dim()) else no_decay).append(p)
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
