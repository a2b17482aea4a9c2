"""Prompt lookup: copy what followed the latest earlier occurrence of the last n tokens."""

from __future__ import annotations

from typing import Any

import torch

from verispec.drafters.base import DraftContext, DrafterBase, Proposal
from verispec.drafters.registry import DrafterSpec, Param
from verispec.validation import positive_int


DEFAULT_K = 5


class PromptLookup(DrafterBase):
    """A deterministic draft from the prompt and output so far (transformers' prompt lookup, vLLM's ngram).

    Tries n-gram sizes from ``ngram`` down to 1 and takes the latest earlier match. It has no draft
    distribution, so under sampling the exact rule runs with q one-hot on the copied token (accept x
    with probability p(x)); the output distribution stays the target's.
    """

    method = "prompt-lookup"

    def __init__(self, ngram: int = 3, k: int = DEFAULT_K) -> None:
        super().__init__(k)
        self.ngram = positive_int(ngram, "ngram")

    def settings(self) -> dict[str, Any]:
        return {"method": self.method, "ngram": self.ngram, "k": self.k}

    def propose(self, context: DraftContext, k: int) -> Proposal:
        return Proposal(torch.tensor(lookup(context.tokens, self.ngram, k), dtype=torch.long), None)


def lookup(tokens: list[int], ngram: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    for n in range(min(ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest match first, never the suffix itself
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


SPEC = DrafterSpec(
    name="prompt-lookup", summary="copies what followed the latest earlier match of the last n tokens",
    params=(Param("ngram", "int", "Draft by prompt lookup with this n-gram size.", default=3,
                  flag="--prompt-lookup", selects=True),),
    build=lambda p, k, load: PromptLookup(**p, k=DEFAULT_K if k is None else k),
    describe=lambda p, target: f"{target} with prompt lookup (n-gram {p.get('ngram', 3)})",
    default_k=DEFAULT_K,
)
