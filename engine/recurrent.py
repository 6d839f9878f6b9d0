"""The recurrent state of a stage's Gated DeltaNet layers for the active sequence, and its
checkpoints: the hybrids' counterpart of the K/V (``engine.kv``), held beside it.

A DeltaNet layer keeps, per sequence, the last ``conv_kernel - 1`` inputs of its causal
convolution and a [head_dim, head_dim] matrix per v head. Unlike K/V it cannot be truncated: a
position's state folds in every position before it. So the state is rewound by snapshot: a
*checkpoint* is a copy of every layer's state after a given prefix of tokens (named by the
prefix's digest), taken where the next prompt can match (the start of each message and the end
of a prompt read, ``Sequences``), a bounded number of them, the oldest dropped first. Rewinding to
position ``n`` restores the latest checkpoint at or before ``n`` whose prefix matches, and the
caller feeds the tokens between again.

The live state records the tokens it has read (``tokens``) and whether a step is writing it
(``dirty``: a step that failed midway leaves it so, and it is never trusted again). Bookkeeping
only — the operation that updates the tensors is ``ops.delta_net``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from strata.engine.ops import DeltaNetSpec

log = logging.getLogger(__name__)

DEFAULT_CHECKPOINTS = 8


def digest(tokens: Sequence[int]) -> bytes:
    """A prefix's name: its tokens' digest."""
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


@dataclass
class Checkpoint:
    position: int
    key: bytes
    conv: torch.Tensor  # [L, K-1, C]
    ssm: torch.Tensor  # [L, Hv, S, S]


class RecurrentState:
    """The states of ``n_layers`` DeltaNet layers (a stage's, in order) on ``device``, and up to
    ``max_checkpoints`` checkpoints (0: none; rewinds then start from position 0)."""

    def __init__(
        self,
        spec: DeltaNetSpec,
        n_layers: int,
        device: torch.device | str = "cpu",
        max_checkpoints: int = DEFAULT_CHECKPOINTS,
    ) -> None:
        if max_checkpoints < 0:
            raise ValueError(f"state checkpoints: {max_checkpoints}, must be at least 0")
        if spec.conv_kernel < 1:
            raise ValueError(f"conv kernel of {spec.conv_kernel} taps: must be at least 1")
        self.spec, self.n_layers = spec, n_layers
        self.device = torch.device(device)
        self.max_checkpoints = max_checkpoints
        S = spec.head_dim
        # conv: [L, K-1, C] the convolution's last inputs; ssm: [L, Hv, S(v), S(k)]
        self.conv = torch.zeros(n_layers, spec.conv_kernel - 1, spec.conv_dim, device=self.device)
        self.ssm = torch.zeros(n_layers, spec.n_v_heads, S, S, device=self.device)
        self.state_bytes = self.conv.nbytes + self.ssm.nbytes
        self.tokens: list[int] = []
        self.dirty = False
        self.checkpoints: list[Checkpoint] = []  # oldest first

    @property
    def nbytes(self) -> int:
        """The live state and every checkpoint held."""
        return self.state_bytes * (1 + len(self.checkpoints))

    def reset(self) -> None:
        """The state of the empty prefix."""
        self.conv.zero_()
        self.ssm.zero_()
        self.tokens = []
        self.dirty = False

    # -- steps ----------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A step starts writing the live state."""
        self.dirty = True

    def advance(self, tokens: Sequence[int]) -> None:
        """The step that read ``tokens`` (after ``self.tokens``) completed."""
        self.tokens.extend(int(t) for t in tokens)
        self.dirty = False

    # -- checkpoints ----------------------------------------------------------------------------

    def checkpoint(self) -> None:
        """Keep a copy of the live state after ``self.tokens`` (the oldest checkpoint goes when
        there are ``max_checkpoints``)."""
        if self.dirty or not self.tokens or self.max_checkpoints == 0:
            return
        n, key = len(self.tokens), digest(self.tokens)
        self.checkpoints = [c for c in self.checkpoints if (c.position, c.key) != (n, key)]
        while len(self.checkpoints) >= self.max_checkpoints:
            self.checkpoints.pop(0)
        self.checkpoints.append(Checkpoint(n, key, self.conv.clone(), self.ssm.clone()))

    def restore(self, prefix: Sequence[int]) -> int:
        """Make the live state that of the longest prefix of ``prefix`` it can: itself where it
        read exactly such a prefix, else the latest matching checkpoint, else the empty
        prefix. Returns that prefix's length (the caller feeds ``prefix`` from there)."""
        n = len(prefix)
        live = len(self.tokens)
        if not self.dirty and live <= n and list(prefix[:live]) == self.tokens:
            best: Checkpoint | None = None
            for c in self.checkpoints:
                if live < c.position <= n and c.key == digest(prefix[: c.position]):
                    if best is None or c.position > best.position:
                        best = c
            if best is None:
                return live
        else:
            best = None
            for c in self.checkpoints:
                if c.position <= n and c.key == digest(prefix[: c.position]):
                    if best is None or c.position > best.position:
                        best = c
        if best is None:
            self.reset()
            return 0
        self.conv.copy_(best.conv)
        self.ssm.copy_(best.ssm)
        self.tokens = [int(t) for t in prefix[: best.position]]
        self.dirty = False
        # the one restored is now the newest: the oldest go first
        self.checkpoints.remove(best)
        self.checkpoints.append(best)
        return best.position

    def drop_checkpoints(self) -> int:
        """Let every checkpoint go (memory pressure); returns the bytes freed."""
        freed = self.state_bytes * len(self.checkpoints)
        self.checkpoints = []
        return freed

    def status(self) -> dict[str, int]:
        return {
            "state_bytes": self.nbytes,
            "state_checkpoints": len(self.checkpoints),
            "state_tokens": len(self.tokens),
        }


def begin_state(state: RecurrentState, start: int) -> None:
    """A step that reads from position ``start`` begins writing ``state``: refused where the
    state holds another prefix's length or a step's that did not complete (a failed one, or
    one run ahead whose token was never committed: the caller restores a checkpoint first)."""
    if state.dirty or len(state.tokens) != start:
        held = "an unfinished step's" if state.dirty else f"{len(state.tokens)} positions'"
        raise RuntimeError(f"the recurrent state holds {held} state, the step starts at {start}")
    state.begin_step()


# the tokens that open a chat message in the templates Strata renders (ChatML, harmony, Llama 3)
MESSAGE_STARTS = ("<|im_start|>", "<|start|>", "<|start_header_id|>")


def message_start_ids(vocabulary: Sequence[str]) -> frozenset[int]:
    """The ids of ``vocabulary``'s message-opening tokens (``MESSAGE_STARTS``)."""
    wanted = set(MESSAGE_STARTS)
    return frozenset(i for i, t in enumerate(vocabulary) if t in wanted)
