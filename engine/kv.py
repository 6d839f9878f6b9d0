"""The K/V cache: one pre-allocated buffer per layer, written in place as positions fill."""

from __future__ import annotations

import torch

KV_DTYPES = {"f16": torch.float16, "f32": torch.float32}


class KVCache:
    def __init__(
        self,
        n_layer: int,
        n_ctx: int,
        n_head_kv: int,
        head_dim: int,
        kind: str = "f16",
        device: torch.device | str = "cpu",
    ) -> None:
        if kind not in KV_DTYPES:
            raise ValueError(f"kv_cache_type {kind!r} is not one of {', '.join(KV_DTYPES)}")
        self.n_ctx = n_ctx
        self.dtype = KV_DTYPES[kind]
        shape = (n_layer, n_ctx, n_head_kv, head_dim)
        # k, v: [L, n_ctx, Hkv, d]. Left uninitialised: only positions [0, length) are ever read,
        # and untouched pages of a long context cost no memory until used.
        self.k = torch.empty(shape, dtype=self.dtype, device=device)
        self.v = torch.empty(shape, dtype=self.dtype, device=device)
        self.length = 0  # positions [0, length) hold valid entries

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [T, Hkv, d]
        end = start + k.shape[0]
        if end > self.n_ctx:
            raise ValueError(f"K/V write up to position {end} beyond the context of {self.n_ctx}")
        self.k[layer, start:end] = k.to(self.dtype)
        self.v[layer, start:end] = v.to(self.dtype)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        # -> k, v: [end, Hkv, d] in float32
        return self.k[layer, :end].float(), self.v[layer, :end].float()

    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on (a prompt sharing a prefix reuses the rest)."""
        self.length = min(self.length, length)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
