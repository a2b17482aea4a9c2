"""Per-run statistics of a decoding run, in vLLM's vocabulary (accepted / recovered / bonus)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class GenerationStats:
    """Counters and timings of one ``generate`` call.

    ``target_calls`` counts every target forward pass, the prefill included. Decode steps are the
    target calls after the prefill; each one commits its accepted drafts plus exactly one recovered
    or bonus token, so ``mean_accepted_length`` (new tokens per decode step) counts that token too:
    plain decoding has 1.0, and a drafter whose K drafts are all kept has K + 1.
    """

    method: str = "plain"
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    k: int = 0
    exact: bool = True
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    seed: int | None = None
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    decode_steps: int = 0
    decode_step_tokens: int = 0  # tokens committed by decode steps (excludes the prefill's token)
    drafted_by_position: list[int] = dataclasses.field(default_factory=list)
    accepted_by_position: list[int] = dataclasses.field(default_factory=list)
    wall_seconds: float = 0.0
    prefill_seconds: float = 0.0
    first_token_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.wall_seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first over the time after the prefill: compares runs of different lengths."""
        seconds = self.wall_seconds - self.prefill_seconds
        return (self.new_tokens - 1) / seconds if seconds > 0 and self.new_tokens > 1 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_rate_by_position(self) -> list[float]:
        """P(candidate i accepted | candidate i was drafted), i = 0..K-1."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def mean_accepted_length(self) -> float:
        """New tokens per decode step, counting the recovered or bonus token (plain decoding: 1.0)."""
        return self.decode_step_tokens / self.decode_steps if self.decode_steps else 0.0

    def record_step(self, drafted: int, accepted: int, committed: int) -> None:
        self.decode_steps += 1
        self.decode_step_tokens += committed
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        grow = drafted - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for i in range(drafted):
            self.drafted_by_position[i] += 1
        for i in range(accepted):
            self.accepted_by_position[i] += 1

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in ("other_seconds", "tokens_per_second", "decode_tokens_per_second", "acceptance_rate", "acceptance_rate_by_position",
                     "mean_accepted_length"):
            out[name] = getattr(self, name)
        return out

    def summary(self) -> str:
        kind = "exact" if self.exact else "APPROXIMATE"
        line = (f"{self.method} ({kind}): {self.new_tokens} tokens in {self.wall_seconds:.2f}s "
                f"({self.tokens_per_second:.1f} tok/s), {self.target_calls} target calls")
        if self.drafted_tokens:
            line += (f", {self.draft_calls} draft calls, acceptance {self.acceptance_rate:.1%}, "
                     f"mean accepted length {self.mean_accepted_length:.2f}, time draft/verify/other "
                     f"{self.draft_seconds:.2f}/{self.verify_seconds:.2f}/{self.other_seconds:.2f}s")
        return line
