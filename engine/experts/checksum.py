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

_WEIGHTS: dict[torch.device, torch.Tensor] = {}


class ExpertCorrupt(EngineError):
    """An expert's bytes in a slot or a host home disagree with its checksum from load."""


def _weights(n_words: int, device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None or w.numel() < n_words:
        w = torch.arange(n_words, dtype=torch.int64, device=device) * 2 + 1
        _WEIGHTS[device] = w
    return w[:n_words]


def checksum(data: torch.Tensor) -> torch.Tensor:
    """The checksum of ``data`` (uint8) as a 0-d int64 tensor on its device (no wait for the
    device). Bytes past the last whole word count one by one, with the next weights."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(
            f"a checksum needs a 1-d uint8 tensor, got {data.dtype} {list(data.shape)}"
        )
    n4 = data.numel() // 4 * 4
    words = data[:n4].view(torch.int32).to(torch.int64)
    rest = data[n4:].to(torch.int64)
    w = _weights(words.numel() + rest.numel(), data.device)
    return (words * w[: words.numel()]).sum() + (rest * w[words.numel() :]).sum()


def checksums(views: Sequence[torch.Tensor]) -> list[int]:
    """The checksums of several byte ranges, fetched with one wait per device."""
    out: list[int | None] = [None] * len(views)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(views):
        by_device.setdefault(v.device, []).append(i)
    for idx in by_device.values():
        sums = torch.stack([checksum(views[i]) for i in idx]).tolist()
        for i, s in zip(idx, sums, strict=True):
            out[i] = int(s)
    return [int(s) for s in out if s is not None]
