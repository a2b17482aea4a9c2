"""Quality checks: greedy agreement, and task metrics against references.

chrF is sacreBLEU's (character n-grams 1..6, beta 2; its defaults) and ROUGE-L the ``rouge-score``
package's (Google's reference implementation: lower-cased, punctuation-split tokens, F-measure), so
the numbers mean what they mean elsewhere. Both libraries are imported on first use.
"""

from __future__ import annotations

import functools
from typing import Sequence


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token; None when equal (a length difference diverges at the end)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@functools.lru_cache(maxsize=1)
def _chrf_metric():
    from sacrebleu.metrics import CHRF

    return CHRF()


@functools.lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"])


def chrf(hypothesis: str, reference: str) -> float:
    """sacreBLEU's sentence-level chrF, 0-100."""
    return float(_chrf_metric().sentence_score(hypothesis, [reference]).score)


def rouge_l(hypothesis: str, reference: str) -> float:
    """ROUGE-L F-measure (rouge-score), 0-100."""
    return 100 * float(_rouge_scorer().score(reference, hypothesis)["rougeL"].fmeasure)


METRICS = {"chrf": chrf, "rouge_l": rouge_l}
