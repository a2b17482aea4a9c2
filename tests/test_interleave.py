"""Lockstep timing (`timing = "interleaved"` in bench configs): the same tokens as runs made alone,
each run timed by its own steps, the runs kept level in the text."""

from __future__ import annotations

import time

import pytest
import torch

import verispec
from verispec.bench.interleave import run_interleaved
from verispec.decoding import Generation
from verispec.sampling import SamplingConfig
from verispec.testing import tiny_model

PROMPTS = ([1, 5, 9], [2, 11, 4, 8, 2, 11, 4], [3, 3, 3, 3])
DRAFTERS = {  # name -> (drafter factory, sampled runs compared too: a fixed K draws the same random numbers)
    "layer-skip": (lambda draft: verispec.LayerSkip(skip=[1], k=3), True),
    "early-exit auto": (lambda draft: verispec.EarlyExit(layer=2, k="auto"), False),
    "low-rank": (lambda draft: verispec.LowRank(rank=8, k=2), True),
    "prompt-lookup": (lambda draft: verispec.PromptLookup(ngram=2, k=4), True),
    "draft-model": (lambda draft: verispec.DraftModel(draft, k=3), True),
}


def _runs(model, draft, prompt, sampling):
    plain = Generation(model, input_ids=prompt, max_new_tokens=20, sampling=sampling, ignore_eos=True)
    others = [Generation(model, input_ids=prompt, max_new_tokens=20, sampling=sampling, ignore_eos=True,
                         drafter=make(draft)) for make, _ in DRAFTERS.values()]
    return [plain, *others]


@pytest.mark.parametrize("sampled", [False, True])
def test_interleaved_runs_give_the_tokens_of_runs_made_alone(sampled):
    model, draft = tiny_model(vocab=16, seed=0, layers=4), tiny_model(vocab=16, seed=1, layers=2)
    sampling = SamplingConfig(temperature=1.0, seed=3) if sampled else SamplingConfig()
    compared = 0
    for prompt in PROMPTS:
        together = run_interleaved(_runs(model, draft, prompt, sampling))
        alone = [run.result() for run in _runs(model, draft, prompt, sampling)]
        for name, a, b in zip(["plain", *DRAFTERS], together, alone):
            if name == "plain" or DRAFTERS[name][1] or not sampled:
                assert a.token_ids == b.token_ids, name
                compared += 1
        if not sampled:  # greedy: every method commits plain decoding's tokens
            assert all(r.token_ids == together[0].token_ids for r in together)
    assert compared >= 3 * (5 if sampled else 6)


def test_a_run_that_shares_a_drafter_with_another_is_refused():
    model = tiny_model(vocab=16, seed=0, layers=4)
    drafter = verispec.PromptLookup(ngram=2, k=2)
    runs = [Generation(model, input_ids=[1, 2, 3], max_new_tokens=8, drafter=drafter) for _ in range(2)]
    with pytest.raises(ValueError, match="drafter each"):
        run_interleaved(runs)


class _SlowLookup(verispec.PromptLookup):
    """Prompt lookup that sleeps in every proposal and notes how far a watched run has come."""

    def __init__(self, pause: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pause, self.watched, self.seen = pause, None, []

    def propose(self, context, k):
        self.seen.append((len(self.watched.new_ids), len(context.tokens)))
        time.sleep(self.pause)
        return super().propose(context, k)


def test_each_run_is_timed_by_its_own_steps_and_the_runs_stay_level():
    model = tiny_model(vocab=16, seed=0, layers=4)
    prompt, n, pause, k = [2, 11, 4, 8, 2, 11, 4], 40, 0.02, 4
    slow_drafter = _SlowLookup(pause, ngram=2, k=k)
    plain = Generation(model, input_ids=prompt, max_new_tokens=n, ignore_eos=True)
    slow = Generation(model, input_ids=prompt, max_new_tokens=n, ignore_eos=True, drafter=slow_drafter)
    slow_drafter.watched = plain
    start = time.perf_counter()
    plain_result, slow_result = run_interleaved([plain, slow])
    elapsed = time.perf_counter() - start
    sleeps = pause * len(slow_drafter.seen)
    assert len(slow_drafter.seen) >= 5
    # The slow run's steps carry its sleeps; the plain run's time does not, although every sleep fell
    # inside its lifetime (the plain run had not finished when the slow one drafted: checked below).
    assert slow_result.stats.wall_seconds >= sleeps
    assert plain_result.stats.wall_seconds < elapsed - 0.9 * sleeps
    assert plain_result.stats.wall_seconds + slow_result.stats.wall_seconds <= elapsed
    # Lockstep: whenever the slow run drafts, the plain run is mid-text and level with it (the slow run
    # is stepped only when it has no more tokens than the plain run; one step commits at most K + 1).
    committed = [tokens - len(prompt) for _, tokens in slow_drafter.seen]
    assert any(plain_done < n for plain_done, _ in slow_drafter.seen)
    assert all(0 <= plain_done - done <= k + 1 or plain_done == n
               for (plain_done, _), done in zip(slow_drafter.seen, committed))
    assert plain_result.token_ids == slow_result.token_ids and slow_result.stats.accepted_tokens > 0
