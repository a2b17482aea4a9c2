"""Prompt lookup: copy what followed the latest earlier occurrence of the last n tokens."""

from __future__ import annotations

from typing import Any

import torch

from verispec.drafters.base import DraftContext, Proposal, validate_k
from verispec.errors import VerispecError


class PromptLookup:
    """A deterministic draft from the prompt and output so far (transformers' prompt lookup, vLLM's ngram).

    Tries n-gram sizes from ``ngram`` down to 1 and takes the latest earlier match. It has no draft
    distribution, so under sampling the exact rule runs with q one-hot on the copied token (accept x
    with probability p(x)); the output distribution stays the target's.
    """

    def __init__(self, ngram: int = 3, k: int = 5) -> None:
        if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 1:
            raise VerispecError(f"ngram must be an integer >= 1, got {ngram!r}")
        self.ngram, self.k = ngram, validate_k(k)

    def settings(self) -> dict[str, Any]:
        return {"method": "prompt-lookup", "ngram": self.ngram, "k": self.k}

    def start(self, context: DraftContext) -> None:
        pass

    def propose(self, context: DraftContext, k: int) -> Proposal:
        return Proposal(torch.tensor(lookup(context.tokens, self.ngram, k), dtype=torch.long), None)

    def accepted(self, num_accepted: int) -> None:
        pass  # stateless


def lookup(tokens: list[int], ngram: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    for n in range(min(ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest match first, never the suffix itself
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []
