"""Lockstep timing: runs of one prompt advance together through the text, each timed by its own steps.

On a shared machine the speed drifts by tens of percent from one minute to the next, so a run that
happens to fall in a slow minute looks slow against the plain run before it: single per-prompt ratios
of a 135M model scatter by +-30%. Interleaving at the granularity of decoding steps puts every run of a
prompt under the same conditions: the scheduler always steps the unfinished run with the fewest
committed tokens (ties in list order), so the runs move through the same stretch of text at the same
moments, and a run's time is the sum of its own steps (its prefill included). A prefill made in chunks
(``Generation(prefill_chunk=...)``, the bench's ``prefill_chunk``) is stepped chunk by chunk the same
way: a long prompt's prefill was one pass of up to 4 s per run, made back to back, and on Spec-Bench's
rag and summarization prompts (half of each run's time) per-prompt ratios of runs that decoded
plainly scattered by 3.4% (standard deviation) against 1.0% for their decoding alone (BENCHMARKS.md
section 24). The weights are shared;
each run keeps its own caches, drafter state and random generator, so its tokens are those of a run
made alone (tested).
"""

from __future__ import annotations

import time
from typing import Sequence

from verispec.decoding import Generation, GenerationResult


def run_interleaved(runs: Sequence[Generation]) -> list[GenerationResult]:
    """Run ``runs`` to their ends in lockstep; each result's ``wall_seconds`` is its own steps' time."""
    if len({id(run.drafter) for run in runs if run.drafter is not None}) < sum(run.drafter is not None for run in runs):
        raise ValueError("interleaved runs need a drafter each: a drafter's state belongs to one run")
    own = [0.0] * len(runs)
    live = list(range(len(runs)))
    while live:
        # the run furthest behind: fewest committed tokens, and in the prefill fewest prompt positions
        # prefilled (min() keeps the first of equals: list order)
        i = min(live, key=lambda j: (len(runs[j].new_ids), runs[j].prefilled))
        start = time.perf_counter()
        if not runs[i].advance():
            live.remove(i)
        own[i] += time.perf_counter() - start
    results = []
    for run, seconds in zip(runs, own):
        result = run.result()
        result.stats.wall_seconds = seconds
        results.append(result)
    return results


__all__ = ["run_interleaved"]
