"""The host tier: the RAM complement of the VRAM cache, in host slots of the cache's layout.

An expert has exactly one home: a VRAM slot, a host slot here, or (beyond the RAM budget) the
file. The tier is one block of host memory (``vmm.pinned.HostMemory``: page-locked and mapped
for the GPU on a CUDA machine, so the decode kernels read a home over PCIe through its device
address; plain memory the CPU reads elsewhere) cut into slots of the cache's slot size. A slot
table (the same bookkeeping as the VRAM cache's, tags and generations included) says which slot
holds which expert; the free slots are the room kept for experts a shrink of the VRAM cache
evicts. The expert cache owns the tier and does every copy in and out of it.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass

import torch

from strata.engine.experts.slots import ExpertKey, SlotTable
from strata.vmm.pinned import PIECE_BYTES, HostMemory, Pinner

MiB = 2**20
GiB = 2**30
# What the automatic budget leaves the desktop, at the least (and an eighth of the memory on
# machines with more than 32 GiB): the browser, the game and the page cache's working set.
KEEP_FREE_BYTES = 4 * GiB


@dataclass(frozen=True)
class HostTierStats:
    """What the tier and the file hold now, for the log and the status."""

    slots: int  # host slots in all (homes + room kept for evictions)
    experts: int  # experts whose home is a host slot
    slot_bytes: int
    file_experts: int  # experts with no home in VRAM or RAM: read from the mapped file

    @property
    def bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def expert_bytes(self) -> int:
        return self.experts * self.slot_bytes


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty where there is none)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    out[name] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def default_budget_bytes(info: dict[str, int] | None = None) -> int:
    """The automatic RAM budget of the tier: the memory available now (``MemAvailable``, which
    counts the GGUF's own cached pages the tier gives back as it copies them) less what the
    desktop keeps: 4 GiB, or an eighth of the machine's memory where that is more. 0 where
    /proc/meminfo says nothing."""
    info = meminfo() if info is None else info
    available, total = info.get("MemAvailable"), info.get("MemTotal")
    if available is None or total is None:
        return 0
    return max(0, available - max(KEEP_FREE_BYTES, total // 8))


def tier_slots(budget_bytes: int, slot_bytes: int, n_experts: int, core_slots: int) -> int:
    """Host slots for a budget: every expert the VRAM core cannot hold has a home when the budget
    allows (the complement of the whole tail included: a shrink to the core finds room), and no
    more than the budget's whole slots."""
    if budget_bytes < 0:
        raise ValueError(f"host_budget of {budget_bytes} bytes is negative")
    return max(0, min(budget_bytes // slot_bytes, n_experts - core_slots))


class HostTier:
    """``n_slots`` host slots of ``slot_bytes``; page-locked through ``pinner`` when given."""

    def __init__(self, n_slots: int, slot_bytes: int, pinner: Pinner | None = None) -> None:
        if n_slots < 1:
            raise ValueError(f"a host tier of {n_slots} slots is empty")
        if slot_bytes < 1:
            raise ValueError(f"host slots of {slot_bytes} bytes: must be positive")
        self.slot_bytes = slot_bytes
        # pieces of whole slots (a slot never straddles two registrations) and whole pages
        unit = math.lcm(slot_bytes, mmap.PAGESIZE)
        piece = max(1, PIECE_BYTES // unit) * unit
        nbytes = -(-n_slots * slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.memory = HostMemory(nbytes, pinner, piece)
        # a copy must not cross from one registration into the next (the driver refuses it)
        self.piece_slots = piece // slot_bytes
        self.table = SlotTable(0, n_slots)
        self.table.plan_grow(n_slots, [])  # every slot usable at once (no fills planned)

    # -- lookups --------------------------------------------------------------------------------

    @property
    def n_slots(self) -> int:
        return self.table.n_slots

    @property
    def pinned(self) -> bool:
        return self.memory.pinned

    def slot_of(self, key: ExpertKey) -> int | None:
        return self.table.slot_of(key)

    def free(self) -> int:
        return self.n_slots - len(self.table)

    def view(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """The bytes of host slot ``slot`` (the first ``nbytes`` of them)."""
        self.table.tag(slot)  # range check
        n = self.slot_bytes if nbytes is None else nbytes
        return self.memory.view(slot * self.slot_bytes, n)

    def address(self, slot: int) -> int:
        """Where the compute device reads host slot ``slot``: its device address where the
        memory is page-locked, its host address otherwise (the CPU reads it)."""
        self.table.tag(slot)
        if self.pinned:
            return self.memory.device_address(slot * self.slot_bytes)
        return self.host_address(slot)

    def host_minus_device(self) -> int | None:
        """What turns a device address of a slot into its host address (``HostMemory``'s)."""
        return self.memory.host_minus_device() if self.pinned else None

    def host_address(self, slot: int) -> int:
        """Where the CPU reads host slot ``slot`` (its host address, page-locked or not)."""
        self.table.tag(slot)
        return self.memory.address + slot * self.slot_bytes

    # -- changes (the expert cache copies the bytes) -------------------------------------------

    def take(self, n: int) -> list[int]:
        """Up to ``n`` free slots, ascending, to copy experts into (then ``assign``)."""
        return self.table.free_slots()[:n] if n > 0 else []

    def assign(self, slot: int, key: ExpertKey) -> None:
        self.table.assign(slot, key)

    def drop(self, key: ExpertKey) -> None:
        """``key`` has left the tier (its bytes are in a VRAM slot, or nowhere it is needed):
        the slot becomes room again, and plain memory goes back to the system."""
        slot = self.table.slot_of(key)
        if slot is None:
            raise KeyError(f"(layer {key[0]}, expert {key[1]}) has no home in the host tier")
        self.table.clear(slot)
        self.memory.release(slot * self.slot_bytes, self.slot_bytes)

    def stats(self, file_experts: int) -> HostTierStats:
        return HostTierStats(self.n_slots, len(self.table), self.slot_bytes, file_experts)

    def close(self) -> None:
        self.memory.close()


def drive_read_bytes() -> int | None:
    """Bytes this process has had read from storage (``/proc/self/io`` ``read_bytes``): what the
    page cache did not have. None where the kernel does not say."""
    try:
        with open(f"/proc/{os.getpid()}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None
