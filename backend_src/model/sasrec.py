"""SASRec (Kang & McAuley, 2018): a causal softmax self-attention baseline for next-item prediction.

    x_i  = E_item[item_i] * sqrt(D) + P[i]                       (learned absolute positions)
    block: x = x + Dropout(MHA_causal(LN(x)))
           x = x + Dropout(W2 Dropout(ReLU(W1 LN(x))))           (pointwise FFN)
    s_i  = LN(x_i);   score(item j | prefix <= i) = s_i . E_item[j]   (shared item table)

Trained with full-softmax cross-entropy over all items at every history position (the
"next item" of position i is the target). Histories are left-aligned with padding 0 on the
right, so under the causal mask a real position only ever attends to real positions.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class SASRecConfig:
    num_items: int  # item indices 1..num_items; 0 is padding
    hidden: int = 64
    num_blocks: int = 2
    num_heads: int = 1
    max_len: int = 50
    dropout: float = 0.5

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class SASRecBlock(nn.Module):
    def __init__(self, cfg: SASRecConfig):
        super().__init__()
        d = cfg.hidden
        self.num_heads = cfg.num_heads
        self.attn_norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ffn_norm = nn.LayerNorm(d)
        self.ffn1 = nn.Linear(d, d)
        self.ffn2 = nn.Linear(d, d)
        self.dropout = nn.Dropout(cfg.dropout)
        self.attn_dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, N, D]
        b, n, d = x.shape
        h = self.num_heads
        q, k, v = self.qkv(self.attn_norm(x)).view(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)  # [B, H, N, d/H]
        # softmax(Q K^T / sqrt(d/H) + causal mask) V
        a = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.attn_dropout if self.training else 0.0
        )
        x = x + self.dropout(self.out(a.transpose(1, 2).reshape(b, n, d)))
        x = x + self.dropout(self.ffn2(self.dropout(F.relu(self.ffn1(self.ffn_norm(x))))))
        return x


class SASRec(nn.Module):
    def __init__(self, cfg: SASRecConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden
        self.item_emb = nn.Embedding(cfg.num_items + 1, d, padding_idx=0)
        self.pos_emb = nn.Embedding(cfg.max_len, d)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(SASRecBlock(cfg) for _ in range(cfg.num_blocks))
        self.final_norm = nn.LayerNorm(d)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_normal_(p)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        """items [B, N] (N <= max_len, left-aligned, 0 = padding) -> states [B, N, D]."""
        n = items.shape[1]
        if n > self.cfg.max_len:
            raise ValueError(f"sequence length {n} exceeds max_len {self.cfg.max_len}")
        pos = torch.arange(n, device=items.device)
        x = self.item_emb(items) * math.sqrt(self.cfg.hidden) + self.pos_emb(pos)[None]
        x = self.emb_dropout(x)
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """states [..., D] -> scores over every item index [..., I+1]; padding column is -inf."""
        scores = states @ self.item_emb.weight.T
        scores[..., 0] = float("-inf")
        return scores

    def loss(self, items: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean full-softmax cross-entropy of the next item over all positions with a target.

        items, targets: [B, N]; targets[b, i] = next item after position i, 0 = no target.
        """
        states = self(items)
        mask = targets > 0
        # only positions with a target are scored: [M, D] @ [D, I+1]
        return F.cross_entropy(self.logits(states[mask]), targets[mask])

    @torch.no_grad()
    def score_last(self, items: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Scores over the full catalog from each user's last history position: [B, I+1]."""
        states = self(items)  # [B, N, D]
        last = states[torch.arange(items.shape[0], device=items.device), (lengths - 1).clamp(min=0)]
        return self.logits(last)
