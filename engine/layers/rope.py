"""Rotary position embeddings in the two layouts GGUF models use.

``neox``: dimension i rotates with i + d/2 (Qwen2/Qwen3). ``normal``: pairs (2i, 2i+1) rotate
together (Llama, Mixtral as llama.cpp lays out their converted weights).
"""

from __future__ import annotations

import torch


class Rope:
    def __init__(self, head_dim: int, theta: float, neox: bool) -> None:
        if head_dim % 2:
            raise ValueError(f"rope needs an even head dimension, got {head_dim}")
        self.head_dim = head_dim
        self.neox = neox
        # inv_freq: [d/2]
        self.inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, H, d], positions: [T]
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]  # [T, d/2]
        cos = angles.cos().to(x.dtype)[:, None, :]  # [T, 1, d/2]
        sin = angles.sin().to(x.dtype)[:, None, :]
        return rotate(x, cos, sin, self.neox)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x: [T, H, d] rotated by the angles whose cos and sin are [T, 1, d/2]."""
    if neox:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)  # [T, H, d/2, 2]
    return out.flatten(-2)
