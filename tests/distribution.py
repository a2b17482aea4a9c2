"""Whole-sequence distribution checks: exact law by enumeration vs. sampled sequences, chi-square.

Sequences are judged over the first ``LENGTH`` = 6 generated tokens: the loop clips K to the token
budget, so a shorter window would run every test with K = 1 and never judge a later candidate, a
re-proposal or a rollback. ``Exercise`` records what the runs really did, and tests assert it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any, Callable

import torch
from scipy import stats as scipy_stats

import verispec
from verispec.sampling import SamplingConfig, logits_to_probs

PROMPT = [1, 2]
LENGTH = 6  # generated tokens compared: with vocabulary 3, 729 sequences


@dataclasses.dataclass
class Exercise:
    """What the sampled runs exercised."""

    runs: int = 0
    deep_steps: int = 0  # runs with a step that accepted >= 2 candidates
    multi_round: int = 0  # runs with >= 2 proposals
    max_k: int = 0  # the most candidates one step judged

    def add(self, stats: Any) -> None:
        self.runs += 1
        by_position = stats.accepted_by_position or []
        self.deep_steps += len(by_position) > 1 and by_position[1] > 0
        self.multi_round += bool(stats.drafted_by_position) and stats.drafted_by_position[0] >= 2
        self.max_k = max(self.max_k, len(stats.drafted_by_position or []))


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
    return sample_with_exercise(model, make_drafter, sampling, n, acceptance, prompt, length)[0]


def sample_with_exercise(model: Any, make_drafter: Callable[[], Any] | None, sampling: SamplingConfig, n: int,
                         acceptance: Any = None, prompt=PROMPT,
                         length=LENGTH) -> tuple[collections.Counter, Exercise]:
    counts: collections.Counter = collections.Counter()
    exercise = Exercise()
    drafter = make_drafter() if make_drafter else None
    for seed in range(n):
        config = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        result = verispec.generate(model, input_ids=prompt, max_new_tokens=length, sampling=config,
                                   drafter=drafter, acceptance=acceptance)
        counts[tuple(result.token_ids)] += 1
        exercise.add(result.stats)
    return counts, exercise


def against_plain(model: Any, make_drafter: Callable[[], Any], sampling: SamplingConfig, seeds: int = 200,
                  acceptance: Any = None, prompt=PROMPT, length: int = 12) -> tuple[int, collections.Counter]:
    """Run each seed speculatively and plainly; return how many seeds gave other tokens, and how the
    speculative steps ended: ``rejected_first`` (candidate 0 rejected), ``rejected_later`` (a candidate
    i >= 1 rejected after i were kept), ``all_kept`` (2+ candidates kept and a bonus drawn)."""
    differing, judged = 0, collections.Counter()
    drafter = make_drafter()
    for seed in range(seeds):
        config = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        run = lambda d, rule: verispec.stream(model, input_ids=prompt, max_new_tokens=length, sampling=config,
                                              drafter=d, acceptance=rule, ignore_eos=True)
        spoken: list[int] = []
        for step in run(drafter, acceptance):
            spoken += step.token_ids
            if not step.drafted or len(step.token_ids) != step.accepted + 1:  # plain, or cut by the length
                continue
            if step.accepted < step.drafted:
                judged["rejected_first" if step.accepted == 0 else "rejected_later"] += 1
            elif step.accepted >= 2:
                judged["all_kept"] += 1
        differing += spoken != run(None, None).result().token_ids
    return differing, judged


def assert_exercised(exercise: Exercise, k: int) -> None:
    """The runs judged K candidates in a step, accepted >= 2 in some step, and re-proposed (K >= 2)."""
    assert exercise.max_k == min(k, LENGTH - 2), exercise
    if k >= 2:
        assert exercise.deep_steps > 0 and exercise.multi_round > 0, exercise


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
