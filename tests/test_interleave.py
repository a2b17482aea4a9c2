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


def _spy_prefill_passes(monkeypatch, model, prompt_length):
    """Note (run, first position, positions) of every target pass over the prompt, a run named by its cache."""
    passes, names = [], {}
    forward = model.forward

    def spied(ids, cache, start, last_only=False):
        if start < prompt_length:
            passes.append((names.setdefault(id(cache), len(names)), start, ids.numel()))
        return forward(ids, cache, start, last_only=last_only)

    monkeypatch.setattr(model, "forward", spied)
    return passes


def test_a_chunked_prefill_gives_the_tokens_and_log_probabilities_of_one_pass():
    model = tiny_model(vocab=16, seed=0, layers=4)
    prompt = [2, 11, 4, 8, 2, 11, 4, 9, 1]
    for make in (lambda: None, lambda: verispec.PromptLookup(ngram=2, k=3)):  # a drafter per run
        whole = Generation(model, input_ids=prompt, max_new_tokens=12, ignore_eos=True, logprobs=True,
                           drafter=make()).result()
        run = Generation(model, input_ids=prompt, max_new_tokens=12, ignore_eos=True, logprobs=True,
                         drafter=make(), prefill_chunk=4)
        steps = list(run)  # iterating a run yields its steps only, never the pauses between prefill chunks
        chunked = run.result()
        assert all(isinstance(step, verispec.Step) for step in steps) and len(steps) == chunked.stats.decode_steps + 1
        assert chunked.token_ids == whole.token_ids
        assert chunked.target_logprobs == pytest.approx(whole.target_logprobs, abs=1e-5)
        assert chunked.stats.target_calls == whole.stats.target_calls + 2  # 9 positions: passes of 4, 4 and 1
    with pytest.raises(verispec.VerispecError, match="prefill_chunk must be an integer >= 1"):
        Generation(model, input_ids=prompt, max_new_tokens=4, prefill_chunk=0)


@pytest.mark.parametrize("scheduler", ["sees the prefill", "blind to the prefill"])
def test_interleaved_runs_step_through_their_prefills_chunk_by_chunk(monkeypatch, scheduler):
    """Lockstep covers the prefill: two runs' chunks alternate, so a long prompt's prefill meets the
    same machine conditions in both. The control hides how far each prefill has come from the
    scheduler (as before chunks were stepped): the first run's chunks then all come first, and it fails."""
    model = tiny_model(vocab=16, seed=0, layers=4)
    prompt = [2, 11, 4, 8, 2, 11, 4, 9, 1]
    passes = _spy_prefill_passes(monkeypatch, model, len(prompt))
    runs = [Generation(model, input_ids=prompt, max_new_tokens=6, ignore_eos=True, prefill_chunk=3,
                       drafter=None if i == 0 else verispec.PromptLookup(ngram=2, k=2)) for i in range(2)]
    if scheduler == "blind to the prefill":
        monkeypatch.setattr(Generation, "prefilled", property(lambda self: 0, lambda self, value: None), raising=False)
    run_interleaved(runs)
    expected = [(run, start, 3) for start in (0, 3, 6) for run in (0, 1)]
    if scheduler == "sees the prefill":
        assert passes == expected
    else:
        assert sorted(passes) == sorted(expected)  # the same passes, in the wrong order
        with pytest.raises(AssertionError):
            assert passes == expected


def test_a_chunked_prefill_is_timed_by_its_own_passes():
    """What runs between two chunks (another run's chunk, under lockstep) is not the run's prefill time."""
    model = tiny_model(vocab=16, seed=0, layers=4)
    run = Generation(model, input_ids=list(range(1, 13)), max_new_tokens=4, ignore_eos=True, prefill_chunk=4)
    began = time.perf_counter()
    while not run.new_ids:
        run.advance()
        time.sleep(0.05)  # between chunks: two pauses before the third chunk gives the first token
    elapsed = time.perf_counter() - began
    assert elapsed >= 0.15
    assert run.stats.prefill_seconds < elapsed - 0.09  # neither pause between chunks counted
    run.result()
    assert run.stats.first_token_seconds == run.stats.prefill_seconds
