"""Self-speculative drafters: greedy identity, early-exit reuse, the whole-sequence law, bad settings."""

from __future__ import annotations

import json

import pytest
import torch

import verispec
from verispec.drafters.base import DraftContext
from verispec.errors import VerispecError
from verispec.sampling import SamplingConfig
from tests.distribution import assert_exercised, chi_square_pvalue, exact_distribution, sample_sequences, sample_with_exercise
from tests.test_speculative import ALPHA, ResidualFromTheWrongRow
from verispec.testing import TableModel, tiny_model

DRAFTERS = {
    "layer-skip": lambda k: verispec.LayerSkip(skip=[1], skip_mlp=[2], k=k),
    "early-exit": lambda k: verispec.EarlyExit(layer=2, k=k),
    "low-rank": lambda k: verispec.LowRank(rank=8, k=k),
    "prompt-lookup": lambda k: verispec.PromptLookup(ngram=2, k=k),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("K", [1, 3, 5])
def test_greedy_output_identical_to_plain(name, K):
    model = tiny_model(vocab=16, seed=0, layers=4)
    accepted = 0
    for prompt in ([1, 5, 9], [3, 3, 3, 3], [7], [2, 11, 4, 8, 2, 11, 4]):
        plain = verispec.generate(model, input_ids=prompt, max_new_tokens=24)
        spec = verispec.generate(model, input_ids=prompt, max_new_tokens=24, drafter=DRAFTERS[name](K))
        assert spec.token_ids == plain.token_ids
        accepted += spec.stats.accepted_tokens
        assert spec.stats.method == name and spec.stats.settings["k"] == K
    assert accepted > 0


def test_early_exit_reuse_gives_full_pass_logits():
    model = tiny_model(vocab=16, seed=3, layers=4)
    prompt = [1, 4, 2, 8, 5, 7]
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, seed=0)):
        cache = model.new_cache(32)
        model.forward(torch.tensor(prompt[:-1]), cache, 0)  # the decoder's invariant: all but the last token
        context = DraftContext(list(prompt), model, cache, sampling, torch.Generator().manual_seed(0))
        drafter = verispec.EarlyExit(layer=2, k=4)
        drafter.start(context)
        proposal = drafter.propose(context, 4)
        inputs = torch.tensor([prompt[-1]] + proposal.tokens.tolist())
        reused = drafter.target_logits(context, inputs)  # [K+1, vocab]
        full = model.forward(torch.tensor(prompt[:-1] + inputs.tolist()), model.new_cache(32), 0)[-5:]
        assert (reused - full).abs().max() <= 1e-4
        # and the cache now equals a full pass's (all layers), so later steps see exact KV
        fresh = model.new_cache(32)
        model.forward(torch.tensor(prompt[:-1] + inputs.tolist()), fresh, 0)
        end = len(prompt) + 4
        assert (cache.keys[:, :, :end] - fresh.keys[:, :, :end]).abs().max() <= 1e-4


def _tiny_target():
    return tiny_model(vocab=3, seed=5, layers=3, hidden=16, sharpness=1.0)


SAMPLED = 2500
# Every transformer drafter, K = 4, six tokens judged; between them temperature, top-k and top-p.
# (tests/matrix.py runs the full product of drafters, temperatures, truncations and K.)
CASES = {"layer-skip": SamplingConfig(1.0, top_p=0.7), "early-exit": SamplingConfig(0.8, top_k=2),
         "low-rank": SamplingConfig(1.0), "draft-model top-k": SamplingConfig(0.8, top_k=2),
         "draft-model top-p": SamplingConfig(1.0, top_p=0.7)}


@pytest.mark.parametrize("case", list(CASES))
def test_transformer_drafters_preserve_target_distribution(case):
    target, sampling, name = _tiny_target(), CASES[case], case.split()[0]
    draft = tiny_model(vocab=3, seed=6, layers=1, hidden=16, sharpness=1.0)
    make = (lambda: verispec.DraftModel(draft, k=4)) if name == "draft-model" else (lambda: DRAFTERS[name](4))
    counts, exercise = sample_with_exercise(target, make, sampling, SAMPLED)
    assert_exercised(exercise, 4)
    pvalue = chi_square_pvalue(counts, exact_distribution(target, sampling))
    assert pvalue >= ALPHA, f"{case}: output departs from the target's law (p = {pvalue:.2e})"


def test_prompt_lookup_preserves_target_distribution_under_sampling():
    target = TableModel(vocab=3, seed=0)
    sampling = SamplingConfig(temperature=0.8, top_k=2)
    prompt = [1, 2, 1, 2, 1]
    counts, exercise = sample_with_exercise(target, lambda: verispec.PromptLookup(ngram=1, k=4), sampling, 6_000,
                                            prompt=prompt)
    assert exercise.deep_steps > 0 and exercise.multi_round > 0
    pvalue = chi_square_pvalue(counts, exact_distribution(target, sampling, prompt=prompt))
    assert pvalue >= ALPHA, f"prompt lookup departs from the target's law (p = {pvalue:.2e})"


def test_negative_control_with_a_self_drafter_is_detected():
    target = _tiny_target()
    sampling = SamplingConfig(temperature=1.0)
    counts = sample_sequences(target, lambda: DRAFTERS["layer-skip"](4), sampling, SAMPLED,
                              acceptance=ResidualFromTheWrongRow())
    pvalue = chi_square_pvalue(counts, exact_distribution(target, sampling))
    assert pvalue < ALPHA, f"a residual from the wrong row with a layer-skip draft went undetected (p = {pvalue:.3f})"


def test_settings_files_round_trip(tmp_path):
    path = tmp_path / "skip.json"
    path.write_text(json.dumps({"method": "layer-skip", "skip": [1], "skip_attention": [], "skip_mlp": [2], "k": 3}))
    drafter = verispec.LayerSkip(str(path))
    assert drafter.settings()["skip"] == [1] and drafter.settings()["skip_mlp"] == [2] and drafter.k == 3
    exit_path = tmp_path / "exit.json"
    exit_path.write_text(json.dumps({"method": "early-exit", "layer": 2, "k": 5}))
    assert verispec.EarlyExit(str(exit_path)).settings()["exit_layer"] == 2
    with pytest.raises(VerispecError, match="not 'early-exit'"):
        verispec.EarlyExit(str(path))
    with pytest.raises(VerispecError, match="cannot read"):
        verispec.LayerSkip(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("make,message", [
    (lambda: verispec.EarlyExit(layer=0), "layer must be"),
    (lambda: verispec.LayerSkip(skip=[]), "at least one"),
    (lambda: verispec.LayerSkip(skip=1), "must be a list of layer indices"),  # found by tests/test_fuzz.py
    (lambda: verispec.LayerSkip(skip=[1.5]), "layer index must be an integer"),
    (lambda: verispec.LowRank(), "exactly one of"),
    (lambda: verispec.LowRank(rank=8, energy=0.5), "exactly one of"),
    (lambda: verispec.LowRank(energy=1.5), "energy"),
    (lambda: verispec.LowRank(rank=8, targets=["ffn"]), "unknown low-rank target"),
])
def test_bad_settings_are_rejected_at_construction(make, message):
    with pytest.raises(VerispecError, match=message):
        make()


@pytest.mark.parametrize("drafter,message", [
    (lambda: verispec.EarlyExit(layer=4), "below the model's 4 layers"),
    (lambda: verispec.LayerSkip(skip=[7]), "outside 0..3"),
    (lambda: verispec.LayerSkip(skip=[0, 1, 2, 3]), "every layer"),
])
def test_bad_settings_for_the_model_are_rejected_before_decoding(drafter, message):
    with pytest.raises(VerispecError, match=message):
        verispec.generate(tiny_model(vocab=16, layers=4), input_ids=[1], max_new_tokens=4, drafter=drafter())


def test_self_drafters_need_the_native_backend(tiny_llama):
    model = verispec.load_model(str(tiny_llama), backend="hf")
    with pytest.raises(VerispecError, match="native backend"):
        verispec.generate(model, input_ids=[1, 2], max_new_tokens=4, drafter=verispec.EarlyExit(layer=1))


def test_low_rank_reports_its_memory_and_full_rank_drafts_are_accepted():
    model = tiny_model(vocab=16, seed=0, layers=2)
    full = verispec.LowRank(rank=64, k=3)  # rank >= every dimension: the factors are exact
    result = verispec.generate(model, input_ids=[1, 2], max_new_tokens=20, drafter=full)
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.settings["factor_megabytes"] > 0 and result.stats.settings["mean_rank"] > 0
