"""The record of one decoding run, in vLLM's vocabulary (accepted / recovered / bonus).

``GenerationStats`` is the only shape a run's numbers take: ``result.stats`` of ``generate``, the
transformers engine of ``verispec bench``, and every bench record (which carries these fields under
these names). Each derived metric is defined once, here. A value an engine cannot observe is
``None``, never an estimate. This module imports neither torch nor the model runtime.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class GenerationStats:
    """Counters and timings of one run.

    ``target_calls`` counts every target forward pass, the prefill included. A decode step is a
    target call that commits tokens after the prefill's first one: it commits its accepted drafts
    plus exactly one recovered or bonus token, so ``mean_accepted_length`` (tokens per decode step)
    counts that token too: plain decoding has 1.0, and a drafter whose K drafts are all kept has
    K + 1. (transformers' assisted generation fuses its prefill with the first verification; its
    engine counts that call as a decode step and all of its tokens as decode-step tokens.)
    """

    method: str = "plain"
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    k: int | str = 0  # the drafter's candidate length, or "auto"
    exact: bool = True
    engine: str = "verispec"  # or "transformers"
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    seed: int | None = None
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_calls: int = 0
    draft_calls: int | None = 0
    drafted_tokens: int | None = 0
    accepted_tokens: int | None = 0
    decode_steps: int = 0
    decode_step_tokens: int = 0  # tokens committed by decode steps (excludes the prefill's token)
    drafted_by_position: list[int] | None = dataclasses.field(default_factory=list)
    accepted_by_position: list[int] | None = dataclasses.field(default_factory=list)
    wall_seconds: float = 0.0
    prefill_seconds: float = 0.0
    first_token_seconds: float = 0.0
    draft_seconds: float | None = 0.0
    verify_seconds: float | None = 0.0  # target calls after the prefill
    k_histogram: dict[int, int] | None = None  # decode steps by the K they ran with (0: no speculation)
    # k="auto" (see verispec.adaptive): what the controller measured, estimated and predicted; None otherwise
    calibration_seconds: float | None = None  # measuring the cost curve (0 when it came from the cache)
    plain_steps: int | None = None  # decode steps run without speculation
    probes: int | None = None  # steps speculated only to re-measure acceptance after plain ones
    warmup_steps: int | None = None  # steps speculated at the start to learn acceptance, whatever the prior predicted
    prior_acceptance: float | None = None  # the pooled acceptance this process's earlier runs left (None: first run)
    candidates_cut: int | None = None  # rated candidates (prompt lookup's) not verified because they would not pay
    cut_to_plain: int | None = None  # steps whose every candidate was cut: run as plain steps
    cost_curve: dict[str, Any] | None = None  # seconds: verification over M = 1..16, proposals of K = 0..8
    acceptance_estimates: list[float] | None = None  # alpha_i by candidate position at the end of the run
    predicted_speedup: float | None = None  # over plain decoding, as the cost model predicted each step
    measured_speedup: float | None = None  # the same yardstick (the measured plain step), as it happened

    DERIVED = ("other_seconds", "tokens_per_second", "decode_tokens_per_second", "per_token_seconds",
               "target_calls_per_token", "acceptance_rate", "acceptance_rate_by_position", "mean_accepted_length")

    @property
    def other_seconds(self) -> float | None:
        """Wall time outside the prefill, drafting and verification (sampling, bookkeeping, detokenising,
        and k="auto"'s cost measurement when it ran)."""
        if self.draft_seconds is None or self.verify_seconds is None:
            return None
        return max(0.0, self.wall_seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def tokens_per_second(self) -> float:
        """End-to-end: new tokens over wall time, the prefill included."""
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after the first over the time after the first token: compares runs of different lengths."""
        seconds = self.wall_seconds - self.first_token_seconds
        return (self.new_tokens - 1) / seconds if seconds > 0 and self.new_tokens > 1 else None

    @property
    def per_token_seconds(self) -> float | None:
        """Mean time per token after the first (the inverse of ``decode_tokens_per_second``)."""
        rate = self.decode_tokens_per_second
        return 1 / rate if rate else None

    @property
    def target_calls_per_token(self) -> float | None:
        return self.target_calls / self.new_tokens if self.new_tokens else None

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts over drafted tokens; None when nothing was drafted or the engine cannot tell."""
        if self.accepted_tokens is None or not self.drafted_tokens:
            return None
        return self.accepted_tokens / self.drafted_tokens

    @property
    def acceptance_rate_by_position(self) -> list[float] | None:
        """P(candidate i accepted | candidate i was drafted), i = 0..K-1; None when not observable."""
        if self.drafted_by_position is None or self.accepted_by_position is None or not self.drafted_by_position:
            return None
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def mean_accepted_length(self) -> float | None:
        """New tokens per decode step, counting the recovered or bonus token (plain decoding: 1.0)."""
        return self.decode_step_tokens / self.decode_steps if self.decode_steps else None

    def record_step(self, drafted: int, accepted: int, committed: int) -> None:
        """One decode step: ``drafted`` candidates, of which ``accepted`` were kept; ``committed`` tokens
        kept in the output (fewer than accepted + 1 when EOS, a stop string or the length cut the step,
        and then ``accepted`` counts only the committed drafts: the loop's ``Step`` already does)."""
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

    def record_auto(self, report: dict[str, Any]) -> None:
        """The k="auto" controller's account (``AutoK.report``)."""
        for name in ("calibration_seconds", "plain_steps", "probes", "warmup_steps", "prior_acceptance", "candidates_cut",
                     "cut_to_plain", "cost_curve", "acceptance_estimates",
                     "predicted_speedup", "measured_speedup"):
            setattr(self, name, report[name])
        self.settings["k_mode"] = report["k_mode"]
        if "auto_fallback" in report:
            self.settings["auto_fallback"] = report["auto_fallback"]

    def as_dict(self) -> dict[str, Any]:
        """Every field and every derived metric, under the names bench records use."""
        out = dataclasses.asdict(self)
        for name in self.DERIVED:
            out[name] = getattr(self, name)
        return out

    def summary(self) -> str:
        kind = "exact" if self.exact else "APPROXIMATE"
        if (self.settings or {}).get("quantization"):
            kind += f", {self.settings['quantization']} target"
        line = (f"{self.method} ({kind}): {self.new_tokens} tokens in {self.wall_seconds:.2f}s "
                f"({self.tokens_per_second:.1f} tok/s), {self.target_calls} target calls")
        if self.drafted_tokens:
            other = self.other_seconds
            line += (f", {self.draft_calls} draft calls, acceptance {self.acceptance_rate:.1%}, "
                     f"mean accepted length {self.mean_accepted_length:.2f}, time draft/verify/other "
                     f"{self.draft_seconds:.2f}/{self.verify_seconds:.2f}/{other:.2f}s")
        if self.predicted_speedup is not None:
            ks = ", ".join(f"K={k}: {n}" for k, n in sorted((self.k_histogram or {}).items()))
            line += (f"; K auto ({ks} steps), predicted {self.predicted_speedup:.2f}x, "
                     f"measured {self.measured_speedup:.2f}x over the measured plain step")
        return line
