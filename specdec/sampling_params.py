"""Per-request sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. Validated at construction.

    temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 64
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
               "temperature", "must be a number >= 0 (0 = greedy)", self.temperature)
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be an int >= 0 (0 = off)",
               self.top_k)
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]",
               self.top_p)
        _check(self.seed is None or (isinstance(self.seed, int) and self.seed >= 0), "seed",
               "must be None or an int >= 0", self.seed)
        _check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "max_new_tokens",
               "must be an int >= 1", self.max_new_tokens)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings", self.stop)
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be ints >= 0", self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {rule}, got {value!r}")
