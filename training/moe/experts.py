"""Expert presets for ``dedloc serve-experts`` (the modules of hivemind's ``--expert_cls``, for side-by-side runs)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn


def expert_seed(seed: int, uid: str) -> int:
    """The torch seed of one expert's initial weights: a function of the server's --seed and the uid
    alone, so that a grid split over processes (``serve-experts --processes``) or hosted in another
    order starts from the same weights."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{uid}".encode(), digest_size=8).digest(), "big") >> 1


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


class FeedforwardBlock(nn.Module):
    """hivemind's ``ffn`` expert: x -> LayerNorm(x + W2 gelu(W1 x)), hidden 4x."""

    def __init__(self, hid_dim: int) -> None:
        super().__init__()
        self.ffn = nn.Linear(hid_dim, 4 * hid_dim)
        self.ffn_output = nn.Linear(4 * hid_dim, hid_dim)
        self.layer_norm = nn.LayerNorm(hid_dim, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layer_norm(x + self.ffn_output(gelu_fast(self.ffn(x))))
        return out


class Identity(nn.Module):
    """hivemind's ``nop`` expert (measures the serving stack alone); one parameter so it trains."""

    def __init__(self, hid_dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(hid_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


#: preset name -> (build(hidden) -> module): every preset takes rows of [hidden] and returns [hidden]
PRESETS: dict[str, Callable[[int], nn.Module]] = {"ffn": FeedforwardBlock, "nop": Identity}
