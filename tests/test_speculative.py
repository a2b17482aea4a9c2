"""Exactness of speculative decoding: algebra, reference agreement, whole-sequence law, greedy identity."""

from __future__ import annotations

import pytest
import torch

import verispec
from verispec.acceptance import (ExactRule, Verdict, VerdictLaw, acceptance_probabilities, coupled_verify, exact_verify,
                                 exact_verify_reference, residual_distribution)
from verispec.errors import VerispecError
from verispec.sampling import SamplingConfig, sample
from tests.distribution import (LENGTH, against_plain, assert_exercised, chi_square_pvalue, exact_distribution, sample_sequences,
                                sample_with_exercise)
from verispec.testing import TableModel, TokenCache, tiny_model

ALPHA = 1e-3
N_SAMPLES = 6_000


def _random_dist(vocab: int, generator: torch.Generator, zeros: int = 0) -> torch.Tensor:
    probs = torch.rand(vocab, generator=generator, dtype=torch.float64) ** 3
    if zeros:  # tokens filtered out (top-k / top-p) on this side only
        probs[torch.randperm(vocab, generator=generator)[:zeros]] = 0
    return probs / probs.sum()


@pytest.mark.parametrize("zeros", [(0, 0), (3, 0), (0, 3), (2, 2)])
def test_acceptance_algebra_recovers_target(zeros):
    """q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) residual(x) == p(x), in float64."""
    g = torch.Generator().manual_seed(7)
    for _ in range(50):
        p, q = _random_dist(12, g, zeros[0]), _random_dist(12, g, zeros[1])
        accept = acceptance_probabilities(torch.arange(12), q.expand(12, 12), p.expand(12, 12))  # per token x
        rejection_mass = 1 - torch.minimum(p, q).sum()
        law = q * accept + rejection_mass * residual_distribution(p, q)
        assert torch.allclose(law, p, atol=1e-12, rtol=0)


def test_residual_edge_cases():
    p = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    assert torch.equal(residual_distribution(p, p.clone()), p)  # empty residual falls back to p
    # q(x) = 0 with p(x) > 0 accepts; p(x) = 0 rejects whatever q says
    probs = acceptance_probabilities(torch.tensor([0, 2]), torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.5, 0.5]]),
                                     torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]))
    assert probs.tolist() == [1.0, 0.0]


def test_sample_never_draws_zero_probability_tokens():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0])
    draws = {sample(probs, g) for _ in range(2000)}
    assert draws == {1, 3}


def test_optimised_exact_verify_matches_reference():
    g = torch.Generator().manual_seed(11)
    for trial in range(300):
        K, vocab = 1 + trial % 4, 7
        target = torch.stack([_random_dist(vocab, g, zeros=trial % 3) for _ in range(K + 1)]).float()
        draft = torch.stack([_random_dist(vocab, g) for _ in range(K)]).float()
        tokens = torch.stack([torch.multinomial(draft[i], 1, generator=g)[0] for i in range(K)])
        for probs in (draft, None):  # a sampled draft and a deterministic one
            a = exact_verify(tokens, probs, target, torch.Generator().manual_seed(trial))
            b = exact_verify_reference(tokens, probs, target, torch.Generator().manual_seed(trial))
            assert a == b


# ---------------------------------------------------------------- whole-sequence distribution tests

class PromptLookupStub(verispec.DrafterBase):
    """A deterministic drafter for the distribution test: proposes a fixed token pattern, no q."""

    method = "fixed-pattern"

    def propose(self, context, k):
        last = context.tokens[-1]
        return verispec.Proposal(torch.tensor([(last + i + 1) % VOCAB for i in range(k)]), None)


VOCAB = 3  # 729 sequences of LENGTH 6
CASES = [  # (temperature, top_k, top_p, K, drafter)
    (1.0, 0, 1.0, 1, "model"),
    (1.0, 0, 1.0, 2, "model"),
    (1.0, 0, 1.0, 4, "model"),
    (0.6, 0, 1.0, 4, "model"),
    (1.5, 0, 1.0, 4, "model"),
    (1.0, 2, 1.0, 4, "model"),
    (1.0, 0, 0.7, 4, "model"),
    (0.8, 0, 1.0, 4, "deterministic"),
    (1.0, 0, 1.0, 4, "padded draft"),  # the draft has 2 more vocabulary rows than the target
    (1.0, 0, 1.0, 4, "smaller draft"),  # the draft has 1 row fewer: fed stand-ins for what it lacks
]


def _target() -> TableModel:
    return TableModel(vocab=VOCAB, seed=0, sharpness=1.5)


def _drafter_factory(kind: str, K: int):
    if kind == "deterministic":
        return lambda: PromptLookupStub(K)
    vocab = {"model": VOCAB, "padded draft": VOCAB + 2, "smaller draft": VOCAB - 1}[kind]
    draft = TableModel(vocab=vocab, seed=99, sharpness=1.5)
    return lambda: verispec.DraftModel(draft, k=K)


@pytest.mark.parametrize("temperature,top_k,top_p,K,kind", CASES)
def test_speculative_sampling_preserves_target_distribution(temperature, top_k, top_p, K, kind):
    target = _target()
    sampling = SamplingConfig(temperature, top_k, top_p)
    law = exact_distribution(target, sampling)
    counts, exercise = sample_with_exercise(target, _drafter_factory(kind, K), sampling, N_SAMPLES)
    assert_exercised(exercise, K)
    pvalue = chi_square_pvalue(counts, law)
    assert pvalue >= ALPHA, f"speculative output departs from the target's law (p = {pvalue:.2e})"


class AlwaysAccept(ExactRule):
    """Negative control: keeps every draft (claims exactness, is wrong)."""

    def verify(self, draft_tokens, draft_probs, target_probs, generator):
        return Verdict(draft_tokens.numel(), sample(target_probs[-1], generator), True)


class ResidualWithoutSubtraction(ExactRule):
    """Negative control: on rejection samples from p instead of max(0, p - q)."""

    def verify(self, draft_tokens, draft_probs, target_probs, generator):
        verdict = exact_verify(draft_tokens, draft_probs, target_probs, generator)
        if verdict.bonus:
            return verdict
        return Verdict(verdict.num_accepted, sample(target_probs[verdict.num_accepted], generator), False)


class ResidualFromTheWrongRow(ExactRule):
    """Negative control, wrong only past the first candidate: a rejection at position i >= 1 samples the
    residual of position i - 1's rows."""

    def law(self, draft_tokens, draft_probs, target_probs):
        law = super().law(draft_tokens, draft_probs, target_probs)
        K = draft_tokens.numel()
        wrong = lambda i: law.replacement(i - 1 if 1 <= i < K else i)
        return VerdictLaw(law.accept, wrong)


class SwitchesLawAfterTheFirst(verispec.DraftModel):
    """Negative control, wrong only past the first candidate: reports the model's q for every candidate
    but draws candidates 2.. uniformly."""

    def propose(self, context, k):
        proposal = super().propose(context, k)
        tokens = proposal.tokens.clone()
        if tokens.numel() > 1:
            tokens[1:] = torch.randint(0, VOCAB, (tokens.numel() - 1,), generator=context.generator)
        return verispec.Proposal(tokens, proposal.probs, proposal.draft_calls)


class TrustingTable(TableModel):
    """A table model whose cache appends at its own length (as transformers' DynamicCache does), so a
    rollback that keeps a stale token changes the context it reads."""

    def forward(self, input_ids, cache, start, last_only=False):
        cache.verified_from = start
        return super().forward(input_ids, cache, cache.length, last_only)


class KeepsOneRejected(TokenCache):
    """Negative control, wrong only past the first candidate: after a rejection at position i >= 1, the
    rollback keeps the first rejected token."""

    verified_from = 0

    def rollback(self, length):
        accepted = length - self.verified_from - 1
        super().rollback(length + 1 if accepted >= 1 and length < self.length else length)


@pytest.mark.parametrize("broken", ["always-accept", "residual-without-subtraction", "residual-from-the-wrong-row",
                                    "switches-law-after-the-first", "rollback-keeps-one-rejected"])
def test_negative_controls_are_detected(broken, monkeypatch):
    target, K = _target(), 4
    draft = TableModel(vocab=VOCAB, seed=99, sharpness=1.5)
    make, acceptance = (lambda: verispec.DraftModel(draft, k=K)), None
    if broken == "always-accept":
        acceptance = AlwaysAccept()
    elif broken == "residual-without-subtraction":
        acceptance = ResidualWithoutSubtraction()
    elif broken == "residual-from-the-wrong-row":
        acceptance = ResidualFromTheWrongRow()
    elif broken == "switches-law-after-the-first":
        make = lambda: SwitchesLawAfterTheFirst(draft, k=K)
    else:
        target = TrustingTable(vocab=VOCAB, seed=0, sharpness=1.5)
        # room for the positions a kept stale token shifts the rest by
        monkeypatch.setattr(target, "new_cache", lambda capacity: KeepsOneRejected(capacity + LENGTH))
    sampling = SamplingConfig(1.0)
    law = exact_distribution(_target(), sampling)
    counts, exercise = sample_with_exercise(target, make, sampling, N_SAMPLES, acceptance=acceptance)
    if broken != "always-accept":  # (always-accepting uses the whole budget in one step: no second round)
        assert_exercised(exercise, K)
    pvalue = chi_square_pvalue(counts, law)
    assert pvalue < ALPHA, f"{broken} went undetected (p = {pvalue:.3f})"


def test_a_trusting_cache_with_a_correct_rollback_passes():
    """The rollback control's model is itself sound: with the loop's real rollback it keeps the law."""
    target, draft = TrustingTable(vocab=VOCAB, seed=0, sharpness=1.5), TableModel(vocab=VOCAB, seed=99, sharpness=1.5)
    sampling = SamplingConfig(1.0)
    counts = sample_sequences(target, lambda: verispec.DraftModel(draft, k=4), sampling, N_SAMPLES)
    assert chi_square_pvalue(counts, exact_distribution(_target(), sampling)) >= ALPHA


def test_plain_sampling_matches_law_and_is_seeded():
    target = TableModel(vocab=VOCAB, seed=3)
    sampling = SamplingConfig(0.9, top_k=2)
    assert chi_square_pvalue(sample_sequences(target, None, sampling, 6000), exact_distribution(target, sampling)) >= ALPHA
    run = lambda seed: verispec.generate(target, input_ids=[1], max_new_tokens=8,
                                         sampling=SamplingConfig(1.0, seed=seed)).token_ids
    assert run(5) == run(5)
    assert len({tuple(run(s)) for s in range(10)}) > 1


# ---------------------------------------------------------------- position-keyed sampling

SAMPLED = [(0.7, 0, 1.0), (1.0, 2, 1.0), (1.0, 0, 0.8)]


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLED)
@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_sampled_prompt_lookup_commits_the_tokens_plain_sampling_commits(temperature, top_k, top_p, K):
    """Each output position is drawn with its own uniform, so a deterministic draft under the exact rule
    commits, seed for seed, what plain sampling commits: rejections at every candidate included."""
    differing, judged = against_plain(_target(), lambda: PromptLookupStub(K), SamplingConfig(temperature, top_k, top_p))
    assert judged["rejected_first"] > 0, judged
    if K >= 2:
        assert judged["rejected_later"] > 0 and judged["all_kept"] > 0, judged
    assert differing == 0, f"{differing} seeds gave other tokens than plain sampling"


class ReadsTheFirstUniformAgain(ExactRule):
    """Negative control, wrong only past the first candidate: candidates 1.. (and the bonus) are judged
    with the uniform of the step's first position instead of their own."""

    coupled = True

    def verify_coupled(self, draft_tokens, target_probs, uniform):
        return coupled_verify(draft_tokens, target_probs, lambda i: uniform(0))


class BonusReadsTheNextPosition(ExactRule):
    """Negative control, wrong only at the bonus: the bonus token reads the next position's uniform."""

    coupled = True

    def verify_coupled(self, draft_tokens, target_probs, uniform):
        K = draft_tokens.numel()
        return coupled_verify(draft_tokens, target_probs, lambda i: uniform(i + 1 if i == K else i))


@pytest.mark.parametrize("broken", [ReadsTheFirstUniformAgain, BonusReadsTheNextPosition])
def test_position_keying_negative_controls_are_detected(broken):
    differing, judged = against_plain(_target(), lambda: PromptLookupStub(4), SamplingConfig(1.0), acceptance=broken())
    assert judged["rejected_later"] > 0 and judged["all_kept"] > 0, judged
    assert differing > 0, f"{broken.__name__} went undetected"


def test_a_rule_that_does_not_declare_coupling_judges_with_the_generator_and_keeps_the_law():
    """A subclass of the exact rule judges deterministic drafts through law/verify and the run's generator
    (a changed law must not inherit the coupled path); the generator path keeps the law too."""

    class Uncoupled(ExactRule):
        pass

    assert ExactRule.coupled and not Uncoupled.coupled
    sampling = SamplingConfig(0.8)
    counts, exercise = sample_with_exercise(_target(), lambda: PromptLookupStub(4), sampling, N_SAMPLES,
                                            acceptance=Uncoupled())
    assert_exercised(exercise, 4)
    assert chi_square_pvalue(counts, exact_distribution(_target(), sampling)) >= ALPHA
    differing, _ = against_plain(_target(), lambda: PromptLookupStub(4), sampling, acceptance=Uncoupled())
    assert differing > 0  # the generator path commits other tokens than plain sampling: it is not coupled


# ---------------------------------------------------------------- greedy equivalence on a real transformer

PROMPTS = [[1, 5, 9], [3, 3, 3, 3], [7], [2, 11, 4, 8, 15, 1]]


@pytest.mark.parametrize("K", [1, 3, 5])
def test_greedy_speculative_equals_plain_greedy(K):
    target = tiny_model(vocab=16, seed=0, layers=2)
    draft = tiny_model(vocab=16, seed=1, layers=1)  # a different model: disagrees often
    rejected = 0
    for prompt in PROMPTS:
        plain = verispec.generate(target, input_ids=prompt, max_new_tokens=24)
        spec = verispec.generate(target, input_ids=prompt, max_new_tokens=24, drafter=verispec.DraftModel(draft, k=K))
        assert spec.token_ids == plain.token_ids
        assert plain.stats.target_calls == 24
        rejected += spec.stats.drafted_tokens - spec.stats.accepted_tokens
    assert rejected > 0, "the draft never disagreed: the test would not exercise rejection"


@pytest.mark.parametrize("K", [2, 4])
def test_draft_equal_to_target_accepts_everything(K):
    target = tiny_model(vocab=16, seed=0, layers=2)
    spec = verispec.generate(target, input_ids=[1, 2, 3], max_new_tokens=31, drafter=verispec.DraftModel(target, k=K))
    plain = verispec.generate(target, input_ids=[1, 2, 3], max_new_tokens=31)
    s = spec.stats
    assert spec.token_ids == plain.token_ids
    assert s.accepted_tokens == s.drafted_tokens and s.acceptance_rate == 1.0
    # prefill gives 1 token; each later call gives K + 1
    assert s.target_calls == 1 + -(-30 // (K + 1))
    assert s.mean_accepted_length == pytest.approx(30 / (s.target_calls - 1))


def test_sampled_draft_equal_to_target_accepts_everything():
    target = TableModel(vocab=5, seed=0)
    result = verispec.generate(target, input_ids=[1], max_new_tokens=20, sampling=SamplingConfig(1.0, seed=1),
                               drafter=verispec.DraftModel(target, k=3))
    assert result.stats.acceptance_rate == 1.0


def test_stats_are_consistent():
    target, draft = tiny_model(vocab=16, seed=0), tiny_model(vocab=16, seed=1, layers=1)
    result = verispec.generate(target, input_ids=[1, 2], max_new_tokens=40, drafter=verispec.DraftModel(draft, k=4),
                               sampling=SamplingConfig(1.0, seed=0))
    s = result.stats
    assert s.new_tokens == len(result.token_ids) == 40
    assert s.decode_step_tokens == 39 and s.decode_steps == s.target_calls - 1
    assert s.accepted_tokens == sum(s.accepted_by_position) <= s.drafted_tokens == sum(s.drafted_by_position)
    assert all(a >= b for a, b in zip(s.accepted_by_position, s.accepted_by_position[1:]))
    assert s.draft_calls == s.drafted_tokens  # a draft model spends one forward pass per candidate
    assert s.mean_accepted_length == s.decode_step_tokens / s.decode_steps
    assert s.acceptance_rate == s.accepted_tokens / s.drafted_tokens
    assert s.tokens_per_second == s.new_tokens / s.wall_seconds
    assert s.prefill_seconds + s.draft_seconds + s.verify_seconds <= s.wall_seconds
    assert s.method == "draft-model" and s.settings["k"] == 4 and s.exact


# ---------------------------------------------------------------- vocabularies

def test_padded_draft_vocabulary_is_masked():
    target = tiny_model(vocab=16, seed=0)
    draft = tiny_model(vocab=20, seed=1, layers=1)  # 4 padding rows at the end
    for sampling in (SamplingConfig(), SamplingConfig(1.0, seed=0)):
        result = verispec.generate(target, input_ids=[1, 2], max_new_tokens=30, sampling=sampling,
                                   drafter=verispec.DraftModel(draft, k=3))
        assert max(result.token_ids) < 16
    assert verispec.generate(target, input_ids=[1, 2], max_new_tokens=20, drafter=verispec.DraftModel(draft, k=3)
                             ).token_ids == verispec.generate(target, input_ids=[1, 2], max_new_tokens=20).token_ids


def test_different_tokenizers_are_rejected():
    class Tok:
        def __init__(self, vocab):
            self.vocab, self.eos_token_id = vocab, None

        def get_vocab(self):
            return self.vocab

        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(str, ids))

    target, draft = tiny_model(vocab=4, seed=0), tiny_model(vocab=4, seed=1)
    target.tokenizer, draft.tokenizer = Tok({"a": 0, "b": 1, "c": 2, "d": 3}), Tok({"a": 0, "b": 1, "x": 2, "d": 3})
    with pytest.raises(VerispecError, match="tokenizer differs"):
        verispec.generate(target, input_ids=[1], max_new_tokens=5, drafter=verispec.DraftModel(draft, k=2))
