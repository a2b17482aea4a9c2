"""Quality checks: greedy agreement, and task metrics against references (chrF, ROUGE-L)."""

from __future__ import annotations

import collections
from typing import Sequence


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token; None when equal (a length difference diverges at the end)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _char_ngrams(text: str, n: int) -> collections.Counter:
    text = "".join(text.split())  # chrF ignores whitespace
    return collections.Counter(text[i:i + n] for i in range(len(text) - n + 1))


def chrf(hypothesis: str, reference: str, max_n: int = 6, beta: float = 2.0) -> float:
    """chrF (Popović 2015) as sacreBLEU computes it by default: character n-grams 1..6, beta 2, 0-100."""
    precisions, recalls = [], []
    for n in range(1, max_n + 1):
        hyp, ref = _char_ngrams(hypothesis, n), _char_ngrams(reference, n)
        if not hyp or not ref:
            continue
        match = sum((hyp & ref).values())
        precisions.append(match / sum(hyp.values()))
        recalls.append(match / sum(ref.values()))
    if not precisions:
        return 0.0
    p, r = sum(precisions) / len(precisions), sum(recalls) / len(recalls)
    if p + r == 0:
        return 0.0
    return 100 * (1 + beta ** 2) * p * r / (beta ** 2 * p + r)


def _lcs(a: list[str], b: list[str]) -> int:
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(hypothesis: str, reference: str) -> float:
    """ROUGE-L F1 (Lin 2004) on lower-cased whitespace tokens, 0-100."""
    hyp, ref = hypothesis.lower().split(), reference.lower().split()
    if not hyp or not ref:
        return 0.0
    lcs = _lcs(hyp, ref)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(hyp), lcs / len(ref)
    return 100 * 2 * p * r / (p + r)


METRICS = {"chrf": chrf, "rouge_l": rouge_l}
