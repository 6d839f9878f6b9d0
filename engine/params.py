"""Per-request knobs: what one generation asks of the sampler. Plain Python, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MIN_TEMPERATURE = 1e-3  # a lower temperature samples greedily (the most likely token)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on the alternatives listed per token


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler; a bad value raises ``ValueError`` naming it."""

    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = field(default_factory=tuple)
    # None: no log-probabilities; N: each generated token's, with the N most likely alternatives
    logprobs: int | None = None
    # the end-of-generation tokens are never chosen (llama.cpp's ignore_eos): for benchmarks
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks = (
            ("max_tokens", self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "a number in [0, 100]"),
            ("top_k", self.top_k >= 0, "an integer >= 0 (0: off)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "a number in (0, 1]"),
            ("min_p", 0.0 <= self.min_p < 1.0, "a number in [0, 1)"),
            ("repeat_penalty", 0.01 <= self.repeat_penalty <= 100.0, "a number in [0.01, 100]"),
            ("repeat_last_n", self.repeat_last_n >= 0, "an integer >= 0"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "an integer in [0, 2^63)"),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                f"an integer in [0, {MAX_TOP_LOGPROBS}]",
            ),
        )
        for name, ok, expected in checks:
            value = getattr(self, name)
            if isinstance(value, bool) or not ok or _nan(value):
                raise ValueError(f"{name}: invalid value {value!r} (expected {expected})")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: invalid value {self.ignore_eos!r} (expected a boolean)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop: invalid value {self.stop!r} (expected non-empty strings)")

    @property
    def greedy(self) -> bool:
        # below the floor, logits / temperature would overflow: such a temperature is greedy
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


def _nan(value: object) -> bool:
    return isinstance(value, float) and math.isnan(value)
