"""The reference's character-level language models (algorithms.md 12.1), layer for layer.

``CharRNN`` (Karpathy 2015): Embedding(65, 128) -> 2-layer LSTM(256) -> Dropout(0.2) -> Linear(256, 65).
``GPTNano`` (nanoGPT-style): token + learned position embeddings (block size 128, d 128), dropout
0.1, four pre-norm blocks (LayerNorm -> causal 4-head self-attention -> dropout -> residual;
LayerNorm -> Linear(128, 512) -> GELU -> Linear(512, 128) -> dropout -> residual), a final
LayerNorm and Linear(128, 65). Both map [n, T] ids to [n, T, 65] logits; GPTNano needs T <= its
block size (the CPU presets train on shorter windows, the position table stays 128).
"""
from __future__ import annotations

import torch
from torch import nn

VOCAB_SIZE = 65


class CharRNN(nn.Module):
    def __init__(self, vocab: int = VOCAB_SIZE, embed: int = 128, hidden: int = 256, layers: int = 2,
                 dropout: float = 0.2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(ids))
        return self.head(self.drop(out))


class Block(nn.Module):
    """Pre-norm transformer block: x + drop(attn(ln1(x))), then x + drop(ff(ln2(x)))."""

    def __init__(self, d: int, heads: int, ff: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)
        x = x + self.drop(a)
        return x + self.drop(self.ff(self.ln2(x)))


class GPTNano(nn.Module):
    def __init__(self, vocab: int = VOCAB_SIZE, d: int = 128, heads: int = 4, layers: int = 4, ff: int = 512,
                 block_size: int = 128, dropout: float = 0.1) -> None:
        super().__init__()
        self.block_size = int(block_size)
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(self.block_size, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, ff, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds the block size {self.block_size}")
        pos = torch.arange(t, device=ids.device)
        x = self.drop(self.tok(ids) + self.pos(pos))
        mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(1)  # True = may not attend
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))
