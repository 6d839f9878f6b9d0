"""Checksums of expert bytes, computed where the bytes are (``verify_experts``).

One number per expert: the sum over its 32-bit words of word x (2i + 1), modulo 2^64 (int64
arithmetic wraps). The weights are odd, so flipping any single bit changes the sum; integer
addition is associative, so the CPU and every GPU give the same number for the same bytes. A
slot on the GPU is summed by the GPU and a page-locked host home through its device address
(over PCIe), so a check costs no copy to the host beyond the one number.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from strata.engine.errors import EngineError


class ExpertCorrupt(EngineError):
    """An expert's bytes in a slot or a host home disagree with its checksum from load."""


def checksum(data: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The checksum of ``data`` (uint8) as a 0-d int64 tensor on its device (no wait for the
    device). Bytes past the last whole word count one by one, with the next weights.
    ``weights``: at least ``len // 4 + len % 4`` weights on that device (made when None)."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(
            f"a checksum needs a 1-d uint8 tensor, got {data.dtype} {list(data.shape)}"
        )
    n4 = data.numel() // 4 * 4
    words = data[:n4].view(torch.int32).to(torch.int64)
    rest = data[n4:].to(torch.int64)
    n = words.numel() + rest.numel()
    w = _weights(n, data.device) if weights is None else weights[:n]
    return (words * w[: words.numel()]).sum() + (rest * w[words.numel() :]).sum()


def _weights(n_words: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n_words, dtype=torch.int64, device=device) * 2 + 1


class Checksummer:
    """Checksums of many byte ranges; keeps the weights on each device it has summed on (its
    owner's memory, dropped by ``close``), grown to the longest range so far."""

    def __init__(self) -> None:
        self._weights: dict[torch.device, torch.Tensor] = {}

    def weights(self, n_words: int, device: torch.device) -> torch.Tensor:
        w = self._weights.get(device)
        if w is None or w.numel() < n_words:
            with torch.inference_mode(False):  # kept across requests, in and outside it
                w = _weights(n_words, device)
            self._weights[device] = w
        return w[:n_words]

    def checksums(self, views: Sequence[torch.Tensor]) -> list[int]:
        """The checksums of several byte ranges, fetched with one wait per device."""
        out: list[int | None] = [None] * len(views)
        by_device: dict[torch.device, list[int]] = {}
        for i, v in enumerate(views):
            by_device.setdefault(v.device, []).append(i)
        for idx in by_device.values():
            longest = max(views[i].numel() // 4 + views[i].numel() % 4 for i in idx)
            w = self.weights(longest, views[idx[0]].device)
            sums = torch.stack([checksum(views[i], w) for i in idx]).tolist()
            for i, s in zip(idx, sums, strict=True):
                out[i] = int(s)
        return [int(s) for s in out if s is not None]

    def close(self) -> None:
        self._weights.clear()
