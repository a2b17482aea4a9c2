"""The drafter protocol: every draft source proposes candidates and learns how many were accepted."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import torch

from verispec.sampling import SamplingConfig, logits_to_probs, sample


@dataclasses.dataclass
class DraftContext:
    """What a drafter may read when it proposes: the committed tokens and the target's state."""

    tokens: list[int]  # every committed token, prompt included; the last one is not yet in the target cache
    target: Any  # the target model (self-speculative drafters run parts of it)
    cache: Any  # the target's KV cache (self-speculative drafters share its committed prefix)
    sampling: SamplingConfig
    generator: torch.Generator


@dataclasses.dataclass
class Proposal:
    """Up to k candidate tokens and the distributions they were drawn from."""

    tokens: torch.Tensor  # [K] long
    probs: torch.Tensor | None  # [K, vocab] q after the sampling transform; None for a deterministic draft
    draft_calls: int = 0  # draft forward passes spent on this proposal
    reuse: Any = None  # optional state the drafter's own verify() uses (early exit's saved hidden states)


@runtime_checkable
class Drafter(Protocol):
    """A draft source. ``k`` is the candidate length it proposes per step."""

    k: int

    def start(self, context: DraftContext) -> None:
        """Called once after the target's prefill: check compatibility, prefill own state."""

    def propose(self, context: DraftContext, k: int) -> Proposal:
        """Propose up to ``k`` tokens continuing ``context.tokens``."""

    def accepted(self, num_accepted: int) -> None:
        """Learn that the first ``num_accepted`` candidates were kept; roll back own state to match."""

    def settings(self) -> dict[str, Any]:
        """The drafter's name and parameters, for stats and records."""


def validate_k(k: int) -> int:
    from verispec.errors import VerispecError

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise VerispecError(f"k (candidate length) must be an integer >= 1, got {k!r}")
    return k


def draft_token(logits: torch.Tensor, sampling: SamplingConfig,
                generator: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """A drafter's choice from [vocab] logits: the argmax when greedy, else a sample from the same
    transform the target uses, returned with that distribution (q)."""
    if sampling.greedy:
        return int(logits.argmax()), None
    probs = logits_to_probs(logits, sampling)  # [vocab]
    return sample(probs, generator), probs
