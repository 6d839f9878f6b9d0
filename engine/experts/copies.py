"""The expert cache's byte moves: whole slots between the arena and the host tier, an expert from
the mapped file into a slot or a home, and the scratch ring the host tier's fill repacks through.

Every copy here is queued on the device's current stream (the exchanges' side stream is
``exchange.Exchanges``'s); the cache decides what moves where and retags afterwards. Nothing here
knows the slot table: slots are numbers, the host tier is passed in where a copy reads or writes
it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from strata.engine.experts.host import HostTier
from strata.engine.experts.provider import FileExpertProvider
from strata.engine.gguf_index import ExpertBlob, GGUFIndex
from strata.engine.quant.expert_layout import kernel_layout, packed_bytes, run_offsets
from strata.vmm.arena import ElasticArena

SCRATCH_SLOTS = 4  # device slots the tier's fill repacks into, used in turn

View = Callable[[int, int], torch.Tensor]  # (slot, nbytes) -> that slot's first nbytes
Ready = Callable[[int], None]  # the arena's wait before it unmaps the chunk at an offset


def chunk_groups(
    pairs: Sequence[tuple[int, int]], slot_bytes: int, chunk_bytes: int
) -> tuple[dict[int, list[tuple[int, int]]], dict[int, int]]:
    """Group (slot, home) copies by the arena chunk each slot starts in; with each chunk that
    any of those slots covers, the lowest group reading it (copies queued top group first, so
    that group's copies are the chunk's last)."""
    groups: dict[int, list[tuple[int, int]]] = {}
    last: dict[int, int] = {}
    for slot, home in pairs:
        first = slot * slot_bytes // chunk_bytes
        groups.setdefault(first, []).append((slot, home))
        for c in range(first, ((slot + 1) * slot_bytes - 1) // chunk_bytes + 1):
            last[c] = min(last.get(c, first), first)
    return groups, last


def copy_runs(
    pairs: Sequence[tuple[int, int]], src_piece: int = 0, dst_piece: int = 0
) -> list[tuple[int, int, int]]:
    """(src slot, dst slot) pairs as runs (src, dst, slots): consecutive slots on both sides go
    as one run, unless it would cross a boundary of ``src_piece`` (``dst_piece``) slots on its
    side (separately page-locked pieces)."""
    pairs = sorted(pairs)
    runs = []
    i = 0
    while i < len(pairs):
        j = i + 1
        while (
            j < len(pairs)
            and pairs[j] == (pairs[i][0] + j - i, pairs[i][1] + j - i)
            and not (src_piece and pairs[j][0] % src_piece == 0)
            and not (dst_piece and pairs[j][1] % dst_piece == 0)
        ):
            j += 1
        runs.append((pairs[i][0], pairs[i][1], j - i))
        i = j
    return runs


class ScratchRing:
    """A ring of device slots used in turn; taking one waits for the copy that last read it
    (its event, recorded by the taker). Allocated on first use, dropped by ``close``. ``event``
    makes each slot's event (None: no events, on the CPU)."""

    def __init__(
        self,
        device: torch.device,
        slot_bytes: int,
        n: int = SCRATCH_SLOTS,
        event: Callable[[], torch.cuda.Event] | None = None,
    ) -> None:
        self.device, self.slot_bytes, self.n = device, slot_bytes, n
        self._event = event
        self._slots: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._next = 0

    def take(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if not self._slots:
            # a plain tensor even when made inside a request's inference mode
            with torch.inference_mode(False):
                self._slots = [
                    (torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device),
                     self._event() if self._event is not None else None)
                    for _ in range(self.n)
                ]  # fmt: skip
        slot, done = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if done is not None:
            done.synchronize()
        return slot, done

    def close(self) -> None:
        self._slots = []
        self._next = 0


class SlotCopies:
    """One cache's copies: its arena's slots, the file's runs, host homes (the tier passed in)."""

    def __init__(
        self,
        index: GGUFIndex,
        file: FileExpertProvider,
        arena: ElasticArena,
        slot_bytes: int,
        device: torch.device,
        kernel: bool,
    ) -> None:
        self.index, self.file, self.arena = index, file, arena
        self.slot_bytes, self.device, self.kernel = slot_bytes, device, kernel
        cuda = device.type == "cuda"
        self.scratch = ScratchRing(device, slot_bytes, event=torch.cuda.Event if cuda else None)

    def expert_bytes(self, blob: ExpertBlob) -> int:
        """An expert's bytes in this cache's layout (a slot's or home's used prefix)."""
        return kernel_layout(blob).nbytes if self.kernel else packed_bytes(blob)

    def slot_view(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        n = self.slot_bytes if nbytes is None else nbytes
        return self.arena.view(slot * self.slot_bytes, n)

    def home_view(self, tier: HostTier, home: int, nbytes: int) -> torch.Tensor:
        """A host home's bytes where the compute device reads them (over PCIe on a GPU)."""
        if tier.pinned and self.device.type == "cuda":
            return tier.memory.device_view(home * tier.slot_bytes, nbytes, self.device.index or 0)
        return tier.view(home, nbytes)

    def view_of(
        self, tier: HostTier | None, where: str, slot: int, blob: ExpertBlob
    ) -> torch.Tensor:
        """The bytes of ``blob``'s copy in arena slot ``slot`` (``where`` "slot") or in host
        home ``slot`` ("home"), where the compute device reads them."""
        n = self.expert_bytes(blob)
        if where == "slot":
            return self.slot_view(slot, n)
        assert tier is not None
        return self.home_view(tier, slot, n)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def copy_slots(
        self,
        pairs: Sequence[tuple[int, int]],
        src: View,
        dst: View,
        src_piece: int = 0,
        dst_piece: int = 0,
    ) -> None:
        """Copy whole slots (src slot, dst slot), asynchronously where the device allows, in
        the runs of :func:`copy_runs`."""
        for s, d, k in copy_runs(pairs, src_piece, dst_piece):
            n = k * self.slot_bytes
            dst(d, n).copy_(src(s, n), non_blocking=True)

    def copy_in(self, slot: int, blob: ExpertBlob) -> None:
        """Write ``blob`` from the file into arena slot ``slot``, in this cache's layout."""
        base = slot * self.slot_bytes
        if self.kernel:
            self.file.upload_kernel(blob, self.arena.view(base, kernel_layout(blob).nbytes))
            return
        for off, run in zip(run_offsets(blob), blob.runs, strict=True):
            dst = self.arena.view(base + off, run.nbytes)
            dst.copy_(self.index.raw(run.offset, run.nbytes), non_blocking=False)

    def write_home(self, tier: HostTier, home: int, blob: ExpertBlob) -> None:
        """Write ``blob`` from the file into host slot ``home``, in this cache's layout."""
        n = self.expert_bytes(blob)
        if not self.kernel:
            dst = tier.view(home, n)
            for off, run in zip(run_offsets(blob), blob.runs, strict=True):
                dst[off : off + run.nbytes].copy_(self.index.raw(run.offset, run.nbytes))
            return
        if self.device.type == "cpu":
            self.file.upload_kernel(blob, tier.view(home, n))
            return
        # repacked on the device (one launch per matrix), then copied down into the home
        scratch, done = self.scratch.take()
        self.file.upload_kernel(blob, scratch)
        tier.view(home, n).copy_(scratch[:n], non_blocking=True)
        if done is not None:
            done.record()

    def copy_out(self, tier: HostTier | None, pairs: Sequence[tuple[int, int]]) -> str | None:
        """Queue the copies of (VRAM slot, host home) pairs; the driver's error when it refused
        one (the caller then leaves every evicted expert to the file)."""
        if not pairs:
            return None
        assert tier is not None
        try:
            self.copy_slots(pairs, self.slot_view, tier.view, dst_piece=tier.piece_slots)
        except RuntimeError as e:
            return str(e).splitlines()[0]
        return None

    def copy_out_top_down(
        self, tier: HostTier | None, pairs: Sequence[tuple[int, int]]
    ) -> tuple[Ready | None, str | None]:
        """Queue the copies of the removed slots' (slot, home) pairs, grouped by the chunk each
        slot starts in, the top group first, an event behind each group. Returns the arena's
        ``ready`` for the unmap (on a GPU: it waits for the event behind the last copy that
        reads the chunk, or behind the moves for a chunk no copy reads) and the driver's error
        when it refused a copy (then no ``ready``: the arena synchronises the device)."""
        if self.device.type != "cuda":
            return None, self.copy_out(tier, pairs)  # (copies on the CPU are done when queued)
        C = self.arena.chunk_bytes
        groups, last = chunk_groups(pairs, self.slot_bytes, C)
        moved = torch.cuda.Event()
        moved.record()  # behind the survivors' copies and the moves
        events: dict[int, torch.cuda.Event] = {}
        for first in sorted(groups, reverse=True):
            error = self.copy_out(tier, groups[first])
            if error is not None:
                return None, error
            events[first] = torch.cuda.Event()
            events[first].record()

        def ready(offset: int) -> None:
            group = last.get(offset // C)
            (moved if group is None else events[group]).synchronize()

        return ready, None

    def close(self) -> None:
        self.scratch.close()
