"""Regression tests for the bugs a review found (issue 11, section 4): each failed before its fix."""

from __future__ import annotations

import logging

import pytest
import torch
from click.testing import CliRunner

import verispec
from tests.conftest import missing_setup
from verispec import kernels
from verispec.cli import main
from verispec.decoding import _Text
from verispec.errors import VerispecError
from verispec.sampling import SamplingConfig
from verispec.testing import TableModel, tiny_model

PROMPT = [1, 2, 3, 4]


def _drafters(k: int) -> dict[str, verispec.Drafter]:
    draft = tiny_model(vocab=16, seed=1, layers=1)
    return {"draft-model": verispec.DraftModel(draft, k=k), "layer-skip": verispec.LayerSkip([1], k=k),
            "early-exit": verispec.EarlyExit(1, k=k), "low-rank": verispec.LowRank(rank=4, k=k),
            "prompt-lookup": verispec.PromptLookup(1, k=k)}


# 1. bf16 verification of more rows than the few-row kernel takes (early exit did not chunk)
@pytest.mark.parametrize("k", [4, 16, 17, 32])
def test_bf16_greedy_speculation_equals_plain_bf16_for_every_drafter(k):
    if not kernels.available():
        missing_setup("bf16 row-for-row identity needs verispec's few-row kernel")
    target = tiny_model(vocab=16, seed=0, layers=3).to_weight_dtype(torch.bfloat16)
    plain = verispec.generate(target, input_ids=PROMPT, max_new_tokens=48)
    for name, drafter in _drafters(k).items():
        if isinstance(drafter, verispec.DraftModel):
            drafter.model.to_weight_dtype(torch.bfloat16)
        spec = verispec.generate(target, input_ids=PROMPT, max_new_tokens=48, drafter=drafter)
        assert spec.token_ids == plain.token_ids, (name, k)


@pytest.mark.parametrize("k", [8, 15, 16, 20, 32])
def test_bf16_early_exit_verification_equals_a_plain_pass_past_the_kernels_rows(k):
    """Early exit verified all K+1 rows in one call: past 16 rows the kernel fell back to bf16
    activations (old: max |difference| 0.046 from a plain pass at K = 16; now ~4e-6, fp32 rounding)."""
    if not kernels.available():
        missing_setup("the few-row kernel decides the bf16 precision this test compares")
    target = tiny_model(vocab=64, seed=0, layers=4, hidden=32).to_weight_dtype(torch.bfloat16)
    prompt = [1, 4, 2, 8, 5, 7]
    cache = target.new_cache(64)
    target.forward(torch.tensor(prompt[:-1]), cache, 0)  # the loop's invariant: all but the last token
    context = verispec.DraftContext(list(prompt), target, cache, SamplingConfig(), torch.Generator().manual_seed(0))
    drafter = verispec.EarlyExit(2, k=k)
    drafter.start(context)
    inputs = torch.tensor([prompt[-1]] + drafter.propose(context, k).tokens.tolist())  # [K+1]
    reused = drafter.target_logits(context, inputs)  # [K+1, vocab]
    fresh = target.new_cache(64)
    target.forward(torch.tensor(prompt[:-1]), fresh, 0)
    plain = target.forward(inputs, fresh, len(prompt) - 1)
    assert (reused - plain).abs().max() <= 1e-4


# 3. re-iterating a Generation restarted it
def test_a_generation_runs_once_however_it_is_iterated():
    model = tiny_model(vocab=16, seed=0)
    expected = verispec.generate(model, input_ids=PROMPT, max_new_tokens=12).token_ids
    run = verispec.stream(model, input_ids=PROMPT, max_new_tokens=12)
    for _ in run:
        break  # the user stops reading after one step
    assert run.result().token_ids == expected and run.result().stats.new_tokens == 12
    twice = verispec.stream(model, input_ids=PROMPT, max_new_tokens=12)
    first = [t for step in twice for t in step.token_ids]
    assert first == expected and list(twice) == [] and twice.result().token_ids == expected


# 4. a draft with fewer vocabulary rows than the target
def test_a_draft_with_fewer_rows_than_the_target(caplog):
    target, draft = tiny_model(vocab=20, seed=0), tiny_model(vocab=16, seed=1, layers=1)
    drafter = verispec.DraftModel(draft, k=3)
    emitted = set()
    with caplog.at_level(logging.WARNING, logger="verispec"):
        for seed in range(20):  # sampled runs reach target ids 16..19, which the draft has no row for
            out = verispec.generate(target, input_ids=PROMPT, max_new_tokens=20, drafter=drafter,
                                    sampling=SamplingConfig(1.5, seed=seed))
            assert len(out.token_ids) == 20
            emitted.update(out.token_ids)
    assert max(emitted) >= 16  # the path that crashed was taken
    assert sum("vocabulary sizes differ" in r.message for r in caplog.records) == 1  # once, not every run
    greedy = verispec.generate(target, input_ids=PROMPT, max_new_tokens=20, drafter=drafter)
    assert greedy.token_ids == verispec.generate(target, input_ids=PROMPT, max_new_tokens=20).token_ids


class NaNAt(TableModel):
    """A table model whose logits turn NaN (or +inf) at one position."""

    def __init__(self, position: int, value: float) -> None:
        super().__init__(vocab=5, seed=0)
        self.position, self.value = position, value

    def forward(self, input_ids, cache, start, last_only=False):
        logits = super().forward(input_ids, cache, start, last_only)
        end = start + input_ids.numel()
        if start <= self.position < end:
            logits = logits.clone()
            logits[self.position - end] = self.value
        return logits


# 5. non-finite probabilities
def test_non_finite_logits_are_refused_and_tiny_temperatures_are_greedy():
    model = tiny_model(vocab=16, seed=0)
    greedy = verispec.generate(model, input_ids=PROMPT, max_new_tokens=10).token_ids
    for t in (1e-38, 1e-300):
        assert verispec.generate(model, input_ids=PROMPT, max_new_tokens=10,
                                 sampling=SamplingConfig(t, seed=0)).token_ids == greedy
    for value in (float("nan"), float("inf")):
        for sampling in (SamplingConfig(), SamplingConfig(1.0, seed=0)):
            for drafter in (None, verispec.PromptLookup(1, k=3)):
                with pytest.raises(VerispecError, match="non-finite logits"):
                    verispec.generate(NaNAt(6, value), input_ids=PROMPT, max_new_tokens=8, sampling=sampling,
                                      drafter=drafter)


# 6. the context limit was off by one
def test_prompt_plus_new_tokens_may_fill_the_context():
    target, draft = tiny_model(vocab=16, seed=0), tiny_model(vocab=16, seed=1, layers=1)
    room = target.config.max_position_embeddings - len(PROMPT)
    for drafter in (None, verispec.DraftModel(draft, k=4), verispec.EarlyExit(1, k=4)):
        out = verispec.generate(target, input_ids=PROMPT, max_new_tokens=room, drafter=drafter)
        assert len(out.token_ids) == room
    with pytest.raises(VerispecError, match="exceeds the model's context"):
        verispec.generate(target, input_ids=PROMPT, max_new_tokens=room + 1)


class GreedyOracle(verispec.DrafterBase):
    """Proposes exactly the target's greedy continuation: every draft is accepted."""

    def propose(self, context, k):
        tokens = list(context.tokens)
        for _ in range(k):
            ids = torch.tensor(tokens)
            tokens.append(int(context.target.forward(ids, context.target.new_cache(len(tokens)), 0)[-1].argmax()))
        return verispec.Proposal(torch.tensor(tokens[len(context.tokens):]), None)


# 7. accepted tokens counted past an EOS that ended the run
def test_stats_count_only_committed_tokens_when_eos_cuts_a_step():
    plain = verispec.generate(tiny_model(vocab=16, seed=4), input_ids=PROMPT, max_new_tokens=30)
    # a token greedy first reaches a few steps in, so an accepted run of drafts spans it
    eos = next(t for i, t in enumerate(plain.token_ids) if i >= 3 and t not in plain.token_ids[:i])
    model = tiny_model(vocab=16, seed=4, eos=(eos,))
    out = verispec.generate(model, input_ids=PROMPT, max_new_tokens=30, drafter=GreedyOracle(8))
    s = out.stats
    cut = out.token_ids.index(eos) + 1
    assert out.finish_reason == "eos" and len(out.token_ids) == s.new_tokens == cut
    assert cut >= 4 and s.decode_steps >= 1
    assert s.decode_step_tokens == s.new_tokens - 1 and s.accepted_tokens <= s.new_tokens - 1
    assert s.mean_accepted_length == (s.new_tokens - 1) / s.decode_steps


class Pieces:
    """A tokenizer stand-in: token i decodes to pieces[i] (many to nothing)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


# 8. stop strings spread over more tokens than the detection window
def test_stop_strings_spread_over_many_tokens_are_found():
    text = _Text(Pieces(["a", "", "b", "x"]), ["ab"])
    tokens = [3, 0] + [1] * 20 + [2]  # "x", "a", twenty empty tokens, "b"
    hits = [text.hits_stop(t) for t in tokens]
    assert hits == [False] * (len(tokens) - 1) + [True]
    assert text.full() == "x"


def test_streamed_text_never_shows_part_of_a_stop_string():
    """A stream holds back an end that could grow into a stop string; the final text releases what did not."""
    text = _Text(Pieces(["he", "l", "lo", " wor", "ld", "!"]), ["lo w", "d!"])
    shown = []
    for token, final in ((0, False), (1, False), (2, False), (3, False)):
        text.hits_stop(token)
        shown.append(text.delta(final))
    assert shown == ["he", "", "l", ""]  # a trailing "l" / "lo" could still begin "lo w": held back
    assert text.full() == "hel"
    assert "".join(shown) + text.delta(final=True) == "hel"
    other = _Text(Pieces(["a", "d", "x"]), ["d!"])
    deltas = [other.hits_stop(t) or other.delta(final) for t, final in ((0, False), (1, False), (2, True))]
    assert deltas == ["a", "", "dx"] and other.full() == "adx"  # "d" was held until "x" ruled the stop out


# 9. the CLI: silent defaults, tracebacks, late validation
@pytest.mark.parametrize("args,message", [
    (["--prompt-lookup", "3", "-k", "0"], "'k'"),
    (["--draft", "absent-model", "-k", "0"], "'k'"),
    (["--prompt-lookup", "0"], "'ngram' must be an integer >= 1"),
    (["--low-rank-rank", "0"], "'rank' must be an integer >= 1"),
    (["--early-exit", "-1"], "'layer' must be an integer >= 1"),
    (["--seed", str(2 ** 64)], "seed must be an integer"),
    (["-m", "no-such-model", "--prompt-lookup", "0"], "'ngram'"),  # drafter checked before the model loads
    (["--prompt-lookup", "2", "--early-exit", "3"], "choose one draft source"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(main, ["generate", "hi", *args])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error:") and message in result.output and "Traceback" not in result.output


def test_cli_junk_gguf_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"definitely not GGUF" * 100)
    result = CliRunner().invoke(main, ["generate", "hi", "-m", str(junk)])
    assert result.exit_code == 2 and "not a readable GGUF file" in result.output and "Traceback" not in result.output
    assert not any((tmp_path / "cache" / "converted").glob("*/model.safetensors"))  # nothing half-written kept


# 10. the API: bools as numbers, float ids truncated, bare errors
def test_api_bad_input_is_a_verispec_error():
    model = tiny_model(vocab=16, seed=0)
    for bad in (dict(temperature=True), dict(top_p=True), dict(seed=2 ** 64)):
        with pytest.raises(VerispecError):
            SamplingConfig(**bad)
    with pytest.raises(VerispecError):
        SamplingConfig(True)
    for ids in ([1.5, 2.0], torch.tensor([[1, 2]]), torch.tensor([1.0, 2.0]), "12", 5):
        with pytest.raises(VerispecError, match="input_ids"):
            verispec.generate(model, input_ids=ids, max_new_tokens=3)
    assert verispec.generate(model, input_ids=torch.tensor(PROMPT), max_new_tokens=3).prompt_ids == PROMPT
    with pytest.raises(VerispecError, match="drafter must implement"):
        verispec.generate(model, input_ids=PROMPT, max_new_tokens=3, drafter=object())


def test_end_of_generation_tokens_end_a_run(tiny_chat_pair, tmp_path):
    """A special token such as <|endoftext|> ends a run even when the config names another EOS (Qwen's
    instruct GGUF names <|im_end|>, but ends code completions with <|endoftext|>); so do
    generation_config.json's EOS ids."""
    import json
    import shutil

    from verispec.decoding import END_OF_GENERATION, eos_ids

    from types import SimpleNamespace

    folder = tmp_path / "model"
    shutil.copytree(tiny_chat_pair[0], folder)
    model = verispec.load_model(str(folder), dtype="float32")

    class Added:  # a tokenizer whose special tokens include an end-of-text that is not its EOS
        eos_token_id = 1

        def get_added_vocab(self):
            return {"<|endoftext|>": 9, "<|im_start|>": 4}

    stand_in = SimpleNamespace(config=model.config, tokenizer=Added(), folder=None)
    assert "<|endoftext|>" in END_OF_GENERATION and "<|im_start|>" not in END_OF_GENERATION
    assert eos_ids(stand_in) == set(model.config.eos_token_ids) | {1, 9}
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert {5, 7} <= eos_ids(verispec.load_model(str(folder), dtype="float32"))
    first = verispec.generate(model, input_ids=[1, 2, 3], max_new_tokens=12, ignore_eos=True).token_ids
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": first[3]}))
    model = verispec.load_model(str(folder), dtype="float32")
    out = verispec.generate(model, input_ids=[1, 2, 3], max_new_tokens=12)
    assert out.finish_reason == "eos" and out.token_ids == first[: first.index(first[3]) + 1]
