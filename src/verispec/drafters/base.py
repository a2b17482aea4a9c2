"""The drafter protocol: every draft source proposes candidates, has them verified, and learns how
many were accepted."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from verispec.adaptive import AUTO, parse_k
from verispec.models.protocol import DecoderModel, KVCacheLike
from verispec.sampling import SamplingConfig, check_logits, logits_to_probs, sample

# K when none is given: chosen per step from costs measured on this machine, 0 (plain decoding) when no
# K pays (verispec.adaptive). It replaced fixed defaults (5 for draft models and prompt lookup, 4 for
# self-speculative drafters), which lose to plain decoding where a draft cannot pay; it does not yet beat
# the best fixed K on every mix (BENCHMARKS.md section 26).
DEFAULT_K: int | str = AUTO


@dataclasses.dataclass
class DraftContext:
    """What a drafter may read when it proposes: the committed tokens and the target's state."""

    tokens: list[int]  # every committed token, prompt included; the last one is not yet in the target cache
    target: DecoderModel  # the target model (self-speculative drafters run parts of it)
    cache: KVCacheLike  # the target's KV cache (self-speculative drafters share its committed prefix)
    sampling: SamplingConfig
    generator: torch.Generator
    # k="auto"'s draft-side stop: asked after each drafted token with the draft's probability of it;
    # False ends the proposal there. None: draft all k.
    keep_drafting: Callable[[float], bool] | None = None


@dataclasses.dataclass
class Proposal:
    """Up to k candidate tokens and the distributions they were drawn from."""

    tokens: torch.Tensor  # [K] long
    probs: torch.Tensor | None  # [K, vocab] q after the sampling transform; None for a deterministic draft
    draft_calls: int = 0  # draft forward passes spent on this proposal
    # A drafter whose whole proposal is known at once, at no cost per candidate (prompt lookup), may
    # rate each candidate (higher: likelier kept; any monotone score): k="auto" then keeps the prefix
    # that pays (``AutoK.cut``), learning the acceptance by this score online. None: no rating.
    confidence: list[float] | None = None

    def prefix(self, n: int) -> "Proposal":
        """The first ``n`` candidates."""
        return dataclasses.replace(self, tokens=self.tokens[:n], probs=None if self.probs is None else self.probs[:n],
                                   confidence=None if self.confidence is None else self.confidence[:n])


@runtime_checkable
class Drafter(Protocol):
    """A draft source. ``k`` is the candidate length it proposes per step, or "auto" (the decoding
    loop then chooses K per step, see ``verispec.adaptive``).

    The decoding loop calls, per run: ``start`` once after the prefill; then per step ``propose``,
    ``target_logits`` (the one verification pass over the last committed token and the candidates),
    and ``accepted``. Subclass ``DrafterBase`` for the usual defaults.
    """

    k: int | str

    def start(self, context: DraftContext) -> None:
        """Called once after the target's prefill: check compatibility, prefill own state."""

    def propose(self, context: DraftContext, k: int) -> Proposal:
        """Propose up to ``k`` tokens continuing ``context.tokens``."""

    def target_logits(self, context: DraftContext, inputs: torch.Tensor) -> torch.Tensor:
        """The target's logits [K+1, vocab] for ``inputs`` [K+1] (last committed token, then the
        candidates) at positions len(tokens)-1.. ; writes their KV into ``context.cache``."""

    def accepted(self, num_accepted: int) -> None:
        """Learn that the first ``num_accepted`` candidates were kept; roll back own state to match."""

    def settings(self) -> dict[str, Any]:
        """The drafter's name and parameters, for stats and records."""


class DrafterBase:
    """Defaults for the ``Drafter`` protocol: a plain target pass verifies, no state to roll back."""

    method = "drafter"

    def __init__(self, k: int | str) -> None:
        self.k = validate_k(k)

    def start(self, context: DraftContext) -> None:
        pass

    def propose(self, context: DraftContext, k: int) -> Proposal:
        raise NotImplementedError

    def target_logits(self, context: DraftContext, inputs: torch.Tensor) -> torch.Tensor:
        return context.target.forward(inputs, context.cache, len(context.tokens) - 1)  # [K+1, vocab]

    def accepted(self, num_accepted: int) -> None:
        pass

    def settings(self) -> dict[str, Any]:
        return {"method": self.method, "k": self.k}


def validate_k(k: Any) -> int | str:
    """A positive integer, or "auto" (optionally "auto:cost" / "auto:confidence" / "auto:both")."""
    return parse_k(k)


def stop_drafting(context: DraftContext, logits: torch.Tensor, token: int, probs: torch.Tensor | None) -> bool:
    """The draft-side stop after ``token`` (drawn from [vocab] ``logits``, or from ``probs`` when
    sampled): True when the run's controller says one more candidate would not pay."""
    if context.keep_drafting is None:
        return False
    confidence = float(probs[token]) if probs is not None else float((logits[token] - logits.float().logsumexp(-1)).exp())
    return not context.keep_drafting(confidence)


def draft_token(logits: torch.Tensor, sampling: SamplingConfig,
                generator: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """A drafter's choice from [vocab] logits: the argmax when greedy, else a sample from the same
    transform the target uses, returned with that distribution (q)."""
    check_logits(logits, "the draft")
    if sampling.greedy:
        return int(logits.argmax()), None
    probs = logits_to_probs(logits, sampling)  # [vocab]
    return sample(probs, generator), probs
