"""Temperature, top-k and top-p as one transform from logits to the distribution actually sampled from.

Speculative decoding is exact only if the draft and the target are compared under the *same*
transform, so every path (plain decoding, draft sampling, verification) calls ``logits_to_probs``.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from verispec.errors import VerispecError
from verispec.validation import integer, number


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. ``temperature=0`` is greedy (top-k/top-p then play no part).

    ``top_k=0`` and ``top_p=1.0`` switch those filters off. ``seed=None`` draws a fresh seed,
    which the run's statistics record so the output can be reproduced.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        number(self.temperature, "temperature", 0)
        number(self.top_p, "top_p", 0, 1, low_open=True)
        integer(self.top_k, "top_k", minimum=0)
        if self.seed is not None:
            integer(self.seed, "seed", minimum=0, maximum=2**64 - 1)  # what torch.Generator accepts

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def resolved_seed(self) -> int:
        return self.seed if self.seed is not None else int.from_bytes(os.urandom(4), "little")

    def describe(self) -> dict[str, float | int | str | None]:
        if self.greedy:
            return {"mode": "greedy"}
        return {"mode": "sampled", "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """[..., vocab] logits -> [..., vocab] fp32 probabilities after temperature, top-k, top-p.

    Greedy gives a one-hot distribution on the argmax, so the exact acceptance rule reduces to
    greedy matching. Filters are applied in transformers' order: temperature, top-k, top-p.
    """
    logits = logits.float()
    if config.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # In float64 with the maximum shifted to 0 before dividing: any temperature > 0 (even 1e-300, which
    # is 0 in float32) then sends every other logit to -inf — the greedy limit, ties shared — instead
    # of overflowing the maximum to inf and the softmax to NaN.
    logits = (logits.double() - logits.double().amax(-1, keepdim=True)) / config.temperature
    if 0 < config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= config.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return logits.softmax(-1).float()


def check_logits(logits: torch.Tensor, who: str) -> None:
    """Refuse logits [..., vocab] no distribution can come from: NaN, +inf, or a row that is all -inf
    (a model that overflowed). -inf alone is a legitimate mask."""
    # The usual case, in one reduction: a row's sum is finite only if every entry is (NaN and +-inf
    # carry through a sum). An elementwise isfinite over SmolLM2's 49k-entry rows took ~140 us a row
    # (torch 2.13, AVX2), the sum ~35 us for a whole 9-row verification. A sum that overflows on finite
    # logits, or a legitimate -inf mask, falls through to the full check, which tells them apart.
    if bool(torch.isfinite(logits.sum(-1)).all()):
        return
    if torch.isnan(logits).any() or torch.isposinf(logits).any() or torch.isneginf(logits).all(-1).any():
        raise VerispecError(f"{who} produced non-finite logits (NaN or inf): its weights or its arithmetic "
                            "overflowed; try dtype='float32'")


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a [vocab] distribution (need not be normalised) by inverting its CDF.

    Several times cheaper than ``torch.multinomial`` for one draw.
    """
    return sample_at(probs, float(torch.rand(1, generator=generator, dtype=torch.float64)))


def sample_at(probs: torch.Tensor, u: float) -> int:
    """The token a uniform ``u`` in [0, 1) picks from a [vocab] distribution: the inverse of its CDF
    in vocabulary order. ``searchsorted(right=True)`` never lands on a zero-probability token, because
    its CDF step is empty."""
    cdf = probs.double().cumsum(-1)  # [vocab]
    index = int(torch.searchsorted(cdf, cdf[-1:] * u, right=True))
    if index >= cdf.numel():  # u rounded up onto the total: take the last token with mass
        index = int((probs > 0).nonzero()[-1])
    return index


_MASK64 = 2**64 - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment


def _finalize64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that the output token at ``position`` (0 = the first new token) is drawn
    with: the position-th output of a SplitMix64 stream started from ``seed``.

    Keying the randomness by output position, not by how many draws a run has made, is what lets a
    speculative run with a deterministic drafter commit exactly the tokens plain sampling commits
    (``verispec.acceptance.coupled_verify``): whatever K was asked, the token at a position is the one
    its uniform picks from the target's distribution there.
    """
    state = (_finalize64((seed + _GAMMA) & _MASK64) + (position + 1) * _GAMMA) & _MASK64
    return (_finalize64(state) >> 11) * 2.0 ** -53
