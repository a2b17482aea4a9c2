"""Whole-sequence distribution checks: exact law by enumeration vs. sampled sequences, chi-square."""

from __future__ import annotations

import collections
import itertools
from typing import Any, Callable

import torch
from scipy import stats as scipy_stats

import verispec
from verispec.sampling import SamplingConfig, logits_to_probs

PROMPT = [1, 2]
LENGTH = 3  # generated tokens compared


def exact_distribution(model: Any, sampling: SamplingConfig, prompt=PROMPT, length=LENGTH) -> dict[tuple, float]:
    """P(x1..xL | prompt) for every sequence, by enumeration with fresh forward passes (no speculation)."""
    vocab = model.config.vocab_size
    law: dict[tuple, float] = {}
    memo: dict[tuple, torch.Tensor] = {}

    def next_probs(prefix: tuple) -> torch.Tensor:
        if prefix not in memo:
            ids = torch.tensor(list(prompt) + list(prefix))
            logits = model.forward(ids, model.new_cache(ids.numel()), 0)[-1]
            memo[prefix] = logits_to_probs(logits, sampling).double()
        return memo[prefix]

    for seq in itertools.product(range(vocab), repeat=length):
        p = 1.0
        for i in range(length):
            p *= float(next_probs(seq[:i])[seq[i]])
            if p == 0:
                break
        if p > 0:
            law[seq] = p
    return law


def sample_sequences(model: Any, make_drafter: Callable[[], Any] | None, sampling: SamplingConfig, n: int,
                     acceptance: Any = None, prompt=PROMPT, length=LENGTH) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    drafter = make_drafter() if make_drafter else None
    for seed in range(n):
        config = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        result = verispec.generate(model, input_ids=prompt, max_new_tokens=length, sampling=config,
                                   drafter=drafter, acceptance=acceptance)
        counts[tuple(result.token_ids)] += 1
    return counts


def chi_square_pvalue(counts: collections.Counter, law: dict[tuple, float]) -> float:
    """Goodness of fit; cells expected below 5 are pooled. A sequence outside the support gives p = 0."""
    n = sum(counts.values())
    if any(seq not in law for seq in counts):
        return 0.0
    observed, expected, pooled_o, pooled_e = [], [], 0, 0.0
    for seq, p in law.items():
        if n * p >= 5:
            observed.append(counts.get(seq, 0))
            expected.append(n * p)
        else:
            pooled_o += counts.get(seq, 0)
            pooled_e += n * p
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    total = sum(expected)
    expected = [e * n / total for e in expected]  # absorb float rounding in the law's total
    return float(scipy_stats.chisquare(observed, expected).pvalue)
