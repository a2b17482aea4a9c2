"""Approximate acceptance rules: their loss measured exactly by enumeration, and matched by sampling."""

from __future__ import annotations

import pytest

import verispec
from verispec.acceptance import ExactRule, LenientRule, TopKRule, TypicalRule, parse_rule
from verispec.divergence import divergence_table, model_next_probs, speculative_law, target_law, total_variation
from verispec.errors import VerispecError
from verispec.sampling import SamplingConfig
from tests.distribution import PROMPT, chi_square_pvalue, exact_distribution, sample_sequences
from verispec.testing import TableModel, perturbed, tiny_model

ALPHA = 1e-3
LENGTH = 3  # the approximate rules' laws are enumerated over 3 tokens (vocabularies 5 and 6)
GRIDS = {  # each from tightest to loosest
    "lenient": [LenientRule(l) for l in (0.9, 0.7, 0.5, 0.3, 0.1)],
    "typical": [TypicalRule(e) for e in (0.5, 0.3, 0.2, 0.1, 0.05)],
    "topk": [TopKRule(k) for k in (1, 2, 3, 4, 5)],
}


def _pair(kind: str):
    if kind == "transformer":  # a 2-layer random transformer and a noisy copy of it as the draft
        target = tiny_model(vocab=6, seed=2, layers=2)
        return target, perturbed(target, seed=102, scale=0.3)
    return TableModel(vocab=5, seed=0, sharpness=1.5), TableModel(vocab=5, seed=99, sharpness=1.5)


@pytest.mark.parametrize("kind", ["transformer", "table"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_divergence_is_zero_for_exact_and_grows_as_rules_loosen(kind, temperature):
    target, draft = _pair(kind)
    sampling = SamplingConfig(temperature)
    p, q = model_next_probs(target, PROMPT, sampling), model_next_probs(draft, PROMPT, sampling)
    for row in divergence_table(p, q, [ExactRule(), LenientRule(1.0)], k=2, length=LENGTH):
        assert row["tv"] < 1e-6 and row["kl"] < 1e-6, row
    for name, rules in GRIDS.items():
        rows = divergence_table(p, q, rules, k=2, length=LENGTH)
        tv = [r["tv"] for r in rows]
        kl = [r["kl"] for r in rows]
        assert all(abs(r["mass"] - 1) < 1e-6 for r in rows)
        # The tightest setting may be lossless on a given pair (top-1 forcing adds max(0, q - p) on the
        # argmax only, zero when the draft never over-weights it, as on the table pair); every looser one loses.
        assert all(v > 1e-4 for v in tv[1:]), f"{name}: an approximate rule showed no loss: {tv}"
        assert all(b >= a - 1e-9 for a, b in zip(tv, tv[1:])), f"{name}: TV not monotone: {tv}"
        assert all(b >= a - 1e-9 for a, b in zip(kl, kl[1:])), f"{name}: KL not monotone: {kl}"
        assert tv[-1] > tv[0] + 1e-3, f"{name}: loosening the rule changed nothing: {tv}"


def test_enumerated_law_is_the_law_generate_samples():
    """The divergence numbers describe the implementation: sampled runs match the enumerated law of the
    approximate rule, and differ detectably from the target's."""
    target, draft = _pair("table")
    sampling = SamplingConfig(1.0)
    p, q = model_next_probs(target, PROMPT, sampling), model_next_probs(draft, PROMPT, sampling)
    for rule in (LenientRule(0.4), TopKRule(2), TypicalRule(0.1)):
        law = speculative_law(p, q, rule, k=2, length=LENGTH)
        counts = sample_sequences(target, lambda: verispec.DraftModel(draft, k=2), sampling, 12_000, acceptance=rule,
                                  length=LENGTH)
        assert chi_square_pvalue(counts, law) >= ALPHA, rule.label()
        if total_variation(law, target_law(p, LENGTH)) > 0.05:
            assert chi_square_pvalue(counts, exact_distribution(target, sampling, length=LENGTH)) < ALPHA, rule.label()


def test_lenient_one_passes_the_whole_sequence_chi_square():
    target, draft = _pair("table")
    sampling = SamplingConfig(1.0)
    counts = sample_sequences(target, lambda: verispec.DraftModel(draft, k=2), sampling, 12_000, acceptance="lenient:1",
                              length=LENGTH)
    assert chi_square_pvalue(counts, exact_distribution(target, sampling, length=LENGTH)) >= ALPHA


def test_approximate_runs_are_marked_and_greedy_topk1_is_plain_greedy():
    target = tiny_model(vocab=12, seed=5, layers=2)
    draft = perturbed(target, seed=7, scale=0.8)
    plain = verispec.generate(target, input_ids=[1, 2, 3], max_new_tokens=24)
    top1 = verispec.generate(target, input_ids=[1, 2, 3], max_new_tokens=24, drafter=verispec.DraftModel(draft, k=3),
                             acceptance="topk:1")
    assert top1.token_ids == plain.token_ids
    assert not top1.stats.exact and top1.stats.settings["acceptance"] == "topk:1"
    assert "APPROXIMATE" in top1.stats.summary()
    loose = verispec.generate(target, input_ids=[1, 2, 3], max_new_tokens=24, drafter=verispec.DraftModel(draft, k=3),
                              acceptance=TopKRule(6))
    assert loose.stats.acceptance_rate > top1.stats.acceptance_rate
    assert verispec.generate(target, input_ids=[1, 2, 3], max_new_tokens=4, acceptance="lenient:1").stats.exact


@pytest.mark.parametrize("spec", ["lenient:0", "lenient:1.5", "lenient", "typical:0", "typical:-1", "typical:0.1,0.2,0.3",
                                  "topk:0", "topk:1.5", "topk:x", "median:3", 3])
def test_bad_rule_parameters_are_clear_errors(spec):
    with pytest.raises(VerispecError):
        parse_rule(spec)
    with pytest.raises(VerispecError):
        verispec.generate(tiny_model(), input_ids=[1], max_new_tokens=2, acceptance=spec)


def test_rule_objects_validate_too():
    for make in (lambda: LenientRule(0), lambda: LenientRule(True), lambda: TypicalRule(0.1, delta=0),
                 lambda: TopKRule(0), lambda: TopKRule(2.0)):
        with pytest.raises(VerispecError):
            make()
    assert parse_rule("typical:0.09").delta == pytest.approx(0.3)
    assert parse_rule("typical:0.09,0.5").delta == 0.5


def test_cli_acceptance_flag(tiny_chat_pair):
    from click.testing import CliRunner

    from verispec.cli import main

    target, draft = tiny_chat_pair
    base = ["generate", "hello", "-m", str(target), "--draft", str(draft), "--dtype", "float32", "-n", "6", "-t", "0.8",
            "--seed", "1", "--no-stream"]
    result = CliRunner().invoke(main, base + ["--acceptance", "topk:3"])
    assert result.exit_code == 0, result.output
    assert "APPROXIMATE" in result.output
    result = CliRunner().invoke(main, base + ["--acceptance", "lenient:0"])
    assert result.exit_code == 2 and "lenience" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, base)
    assert result.exit_code == 0 and "(exact)" in result.output
