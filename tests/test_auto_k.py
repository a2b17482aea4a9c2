"""k="auto": the cost model, the controller's choices, exactness with K changing every step, bad input."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random

import pytest
import torch
from click.testing import CliRunner

import verispec
from verispec import adaptive, kernels
from verispec.adaptive import Acceptance, AutoK, CostCurve, expected_tokens, parse_k
from verispec.errors import VerispecError
from verispec.sampling import SamplingConfig
from verispec.testing import TableModel, tiny_model
from tests.distribution import against_plain, chi_square_pvalue, exact_distribution, sample_with_exercise
from tests.distribution import LENGTH
from tests.test_speculative import ALPHA, N_SAMPLES, VOCAB, _target

K_MAX = adaptive.K_MAX


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Cost measurements go to a temporary cache; nothing measured in one test serves another."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(adaptive, "_MEASURED", {})
    monkeypatch.setattr(adaptive, "_LEARNED", {})
    monkeypatch.setattr(adaptive, "_ROW_COSTS", {})


def _curve(verify_per_row: float = 0.02, draft_per_token: float = 0.2) -> CostCurve:
    """A synthetic machine: a verification pass costs 1 + verify_per_row per extra row, a draft token
    ``draft_per_token`` (in plain-step units)."""
    return CostCurve(verify=[1.0 + verify_per_row * m for m in range(adaptive.CURVE_ROWS)],
                     draft=[draft_per_token * k for k in range(K_MAX + 1)])


def _controller(curve: CostCurve, mode: str = "both", warm: bool = True) -> AutoK:
    """A controller on ``curve``; ``warm``: past its start-of-run warm-up (tests that feed acceptance
    straight into its estimates)."""
    auto = AutoK(mode)
    auto.curve = curve
    if warm:
        auto.judged = adaptive.WARMUP_JUDGED
    return auto


# ---------------------------------------------------------------- the arithmetic

def test_expected_tokens_is_the_chain_formula():
    alphas = [0.9, 0.5, 0.2]
    assert expected_tokens(alphas, 0) == 1.0
    assert expected_tokens(alphas, 1) == pytest.approx(1.9)
    assert expected_tokens(alphas, 3) == pytest.approx(1 + 0.9 + 0.45 + 0.09)


def test_acceptance_is_censoring_aware():
    """After the first rejection, later positions were never judged: they must not count as rejected."""
    acceptance = Acceptance()
    for _ in range(50):
        acceptance.observe(proposed=6, accepted=1)  # position 0 kept, 1 rejected, 2..5 never judged
    assert acceptance.judged[2:] == [0.0] * (K_MAX - 2)
    alphas = acceptance.alphas()
    assert alphas[0] > 0.9 and alphas[1] < 0.1
    # unjudged positions take the pooled rate (about half here), not zero
    assert 0.3 < alphas[3] < 0.7
    acceptance.observe(proposed=2, accepted=2)  # all kept: both positions judged, nothing rejected
    assert acceptance.judged[2] == 0.0


# ---------------------------------------------------------------- the choices

def test_a_good_drafter_gets_a_long_k_and_a_bad_one_none():
    good = _controller(_curve(draft_per_token=0.05))
    for _ in range(40):
        good.acceptance.observe(8, 8)
    assert good.choose(budget=100) >= 6

    bad = _controller(_curve(draft_per_token=0.4))
    for _ in range(40):
        bad.acceptance.observe(4, 0)
    assert bad.choose(budget=100) == 0


def test_k_is_never_above_the_budget():
    auto = _controller(_curve(draft_per_token=0.01))
    for _ in range(40):
        auto.acceptance.observe(8, 8)
    assert auto.choose(budget=3) == 3
    assert auto.choose(budget=0) == 0


def test_cached_positions_make_every_verified_row_dearer():
    """The curve was measured at one context; far beyond it each verified row attends to many more
    positions, and a K that paid near the start stops paying."""
    curve = _curve(verify_per_row=0.02, draft_per_token=0.0)
    curve.context, curve.attention = 100, 0.001  # 1000 more cached positions: one more plain step per row
    auto = _controller(curve)
    auto._tokens = list(range(101))  # the measured context
    for accepted in [2, 3, 4, 5, 6, 7, 8, 8] * 4:  # later candidates kept less often
        auto.acceptance.observe(proposed=8, accepted=accepted)
    near = auto.choose(budget=64)
    auto._tokens = list(range(5101))  # 5000 positions later
    far = auto.choose(budget=64)
    assert near >= 3 and far < near
    assert auto.cost(0) == pytest.approx(1.0 + 0.001 * 5000)  # a plain step pays it once
    assert auto.cost(3) == pytest.approx(1.0 + 0.02 * 3 + 0.001 * 4 * 5000)


def test_the_attention_cost_is_measured_on_the_native_runtime():
    assert adaptive.attention_seconds(tiny_model(vocab=16, hidden=128, layers=2)) > 0
    assert adaptive.attention_seconds(object()) == 0.0  # another backend: no per-position term


@pytest.mark.parametrize("by_position", [True, False])
def test_the_first_candidate_keeps_its_own_long_run_rate(by_position):
    """A quantized self-draft on an AMD EPYC: a draft step costs 0.72 of a plain step, its first
    candidate is kept 95% of the time and each later one 60%. After a plain stretch (the recent counts
    forgotten) K=1 still pays by 7%: the first position's estimate falls back to its own long-run rate.
    Control: without the long-run counts by position it falls back to the rate pooled over every
    position, which the later ones drag down, and K=1 looks 1.4% faster than plain, short of MARGIN."""
    rng = random.Random(0)
    auto = _controller(_curve(draft_per_token=0.72, verify_per_row=0.07))
    for _ in range(120):
        accepted = 0
        while accepted < K_MAX and rng.random() < (0.95 if accepted == 0 else 0.6):
            accepted += 1
        auto.acceptance.observe(K_MAX, accepted)
    for _ in range(40):
        auto.acceptance.observe(0, 0)
    if not by_position:
        auto.acceptance.slow_kept = [0.0] * K_MAX
        auto.acceptance.slow_judged = [0.0] * K_MAX
    first = auto.acceptance.alphas()[0]
    if by_position:
        assert first > 0.9 and auto.choose(budget=100) == 1
    else:
        assert first < 0.85 and auto.choose(budget=100) == 0


def test_plain_decoding_probes_then_speculation_returns():
    """With K = 0 nothing is learned, so a cheap probe runs every PROBE_FIRST plain steps while probes
    find nothing (their cost stays under PROBE_SHARE); once the text turns predictable, speculation
    comes back."""
    auto = _controller(_curve(draft_per_token=0.05))  # a probe costs 0.07 plain steps: PROBE_FIRST decides
    for _ in range(40):
        auto.acceptance.observe(4, 0)
    ks = []
    for _ in range(3 * (adaptive.PROBE_FIRST + 1)):
        k = auto.choose(budget=1000)
        ks.append(k)
        auto.observe(k, k, 0, 1, 0.05 * k, 1.0 + 0.02 * k, 0.0)  # every probe rejected at once
    probes = [i for i, k in enumerate(ks) if k]
    step = adaptive.PROBE_FIRST + 1
    assert probes == [adaptive.PROBE_FIRST, adaptive.PROBE_FIRST + step, adaptive.PROBE_FIRST + 2 * step]
    # the text turns copy-heavy: probes now see every candidate kept, and speculation stays on
    ks = []
    for _ in range(200):
        k = auto.choose(budget=1000)
        ks.append(k)
        auto.observe(k, k, k, k + 1, 0.05 * k, 1.0 + 0.02 * k, 0.0)
    assert all(k > 0 for k in ks[-50:])


def test_an_expensive_draft_probes_less_often():
    """Probes stay under PROBE_SHARE of the time: a draft costing 0.9 of a step waits ~92 plain steps."""
    auto = _controller(_curve(draft_per_token=0.9))
    for _ in range(40):
        auto.acceptance.observe(4, 0)
    ks = []
    for _ in range(120):
        k = auto.choose(budget=1000)
        ks.append(k)
        auto.observe(k, k, 0, 1, 0.9 * k, 1.0 + 0.02 * k, 0.0)
    first = ks.index(next(k for k in ks if k))
    assert first == math.ceil((0.9 + 0.02) / (adaptive.PROBE_SHARE * 1.0))


def test_after_a_dip_in_a_run_where_speculation_pays_probes_come_back_sooner():
    """A 0.5B draft for a 1.5B target (0.36 of a step): a run that kept nearly everything hits a
    stretch of rejections and goes plain. Its long-run acceptance still says a probe commits about the
    tokens its time is worth, so the next probe comes after PROBE_FIRST plain steps, where pricing it at
    its whole extra time would allow one after ~37. Control: the same dip in a run whose long run was
    poor waits that long (test_an_expensive_draft_probes_less_often)."""
    def plain_steps_before_a_probe(history_kept: int) -> int:
        auto = _controller(_curve(draft_per_token=0.36, verify_per_row=0.01))
        for _ in range(150):
            auto.acceptance.observe(2, history_kept)
        for _ in range(25):
            auto.acceptance.observe(2, 0)
        assert auto.acceptance.alphas()[0] < 0.4
        for step in range(100):
            k = auto.choose(budget=1000)
            if k:
                return step
            auto.observe(0, 0, 0, 1, 0.0, 1.0, 0.0)
        return 100
    assert plain_steps_before_a_probe(history_kept=2) == adaptive.PROBE_FIRST
    assert plain_steps_before_a_probe(history_kept=0) >= 2 * adaptive.PROBE_FIRST


@pytest.mark.parametrize("kept", [True, False])
def test_a_run_starts_by_speculating_until_it_has_evidence(kept, monkeypatch):
    """A draft costing 0.45 of a step: at the prior (acceptance 1/2) plain decoding looks as good as any
    K. The run speculates anyway until WARMUP_JUDGED candidates were judged or the warm-up cost
    WARMUP_SHARE of the run's plain decoding, then follows the evidence: a draft that is mostly kept
    keeps speculating, one that is rejected goes plain. Negative control: without the warm-up the good
    draft is not tried before the first probe (one rejection in the first step did that to a real run)."""
    def run(warmup: int) -> tuple[list[int], int]:
        monkeypatch.setattr(adaptive, "WARMUP_JUDGED", warmup)
        auto = _controller(_curve(draft_per_token=0.45, verify_per_row=0.05), warm=False)
        ks = []
        for step in range(60):
            k = auto.choose(budget=128 - step)
            ks.append(k)
            accepted = (k if kept else 0) if step % 5 else 0  # every fifth step a rejection at once
            auto.observe(k, k, accepted, accepted + 1, 0.45 * k, 1.0 + 0.05 * k, 0.0)
        return ks, auto.warmup_steps
    ks, warmup = run(8)
    assert all(k > 0 for k in ks[:warmup])
    if kept:  # two kept of three judged: the evidence says speculate, and it does from then on
        assert 1 <= warmup <= 3 and sum(k > 0 for k in ks) >= 55
        assert all(k == 0 for k in run(0)[0][:adaptive.PROBE_FIRST])  # until the first probe
    else:  # 1.5% of 128 plain steps (1.92) at 0.5 of a step extra each: 3 steps, then plain
        assert warmup == 3 and all(k == 0 for k in ks[3:9]) and sum(k > 0 for k in ks) < 8


def test_a_short_proposal_ends_the_chain():
    """Prompt lookup's match ran out after 2 kept candidates: position 2 counts as rejected."""
    auto = _controller(_curve(draft_per_token=0.0))
    for _ in range(30):
        auto.choose(budget=100)
        auto.observe(6, 2, 2, 3, 0.0, 1.0, 0.0)
    alphas = auto.acceptance.alphas()
    assert alphas[0] > 0.9 and alphas[1] > 0.9 and alphas[2] < 0.1


def test_asking_for_more_than_a_proposal_holds_costs_only_what_it_holds():
    """Prompt lookup's match runs out after 2 candidates whatever K asks for: a step asking for 6
    verifies 3 rows, and the controller prices it so (and so does not shy away from a longer K that
    costs nothing more). Control: a drafter that fills every K is priced at K + 1 rows."""
    curve = _curve(verify_per_row=0.2, draft_per_token=0.0)
    short, full = _controller(curve), _controller(_curve(verify_per_row=0.2, draft_per_token=0.0))
    for step in range(40):
        short.choose(budget=100), full.choose(budget=100)
        k = 2 + step % 5  # asked for 2..6
        short.observe(k, 2, 1, 2, 0.0, curve.verify[2], 0.0)
        full.observe(k, k, 1, 2, 0.0, curve.verify[k], 0.0)
    for k in (3, 4, 6):
        assert short.asking(k)[k] == pytest.approx(short.cost(2), rel=0.03)
        assert full.asking(k)[k] == pytest.approx(full.cost(k), rel=1e-6)
    assert full.asking(6)[6] > 1.5 * short.asking(6)[6]
    # half the proposals hold 2 and half hold 4: a step asking for 4 costs the mean of both
    mixed = _controller(_curve(verify_per_row=0.2, draft_per_token=0.0))
    for step in range(200):
        mixed.choose(budget=100)
        mixed.observe(4, 2 if step % 2 else 4, 1, 2, 0.0, 1.0, 0.0)
    assert mixed.asking(4)[4] == pytest.approx((mixed.cost(2) + mixed.cost(4)) / 2, rel=0.05)
    assert mixed.asking(3)[3] == pytest.approx((mixed.cost(2) + mixed.cost(3)) / 2, rel=0.05)


def test_steps_with_nothing_to_propose_are_plain_steps_not_rejections():
    """Prompt lookup finds a match on one step in four, and then its candidates are kept: asking costs
    nothing on the other three (they are plain steps), so the controller keeps asking, and predicts
    the mixture of both kinds of step. Counted as rejections, the empty steps would put acceptance
    near 1/4, where a verified row's 0.3 steps of extra cost does not pay: plain decoding."""
    auto = _controller(_curve(verify_per_row=0.3, draft_per_token=0.0))
    ks = []
    for step in range(80):
        k = auto.choose(budget=100)
        ks.append(k)
        proposed = min(k, 3) if step % 4 == 0 else 0
        auto.observe(k, proposed, proposed, proposed + 1, 0.0, 1.0 + 0.3 * proposed, 0.0)
    assert all(ks[40:])  # never plain
    assert 0.15 < auto.proposes < 0.4 and auto.acceptance.alphas()[0] > 0.9
    m, k = auto.proposes, auto.choose(budget=100)
    tokens, seconds = auto._prediction  # a quarter of the steps commit K + 1 tokens, the rest one
    assert tokens == pytest.approx(m * expected_tokens(auto._alphas, k) + 1 - m)
    assert seconds == pytest.approx(m * auto.asking(k)[k] + (1 - m) * auto.cost(0))
    # it never holds more than 3: asking for 3 costs 3 rows; asking for more (rarely tried, so the chance
    # of a 4th candidate is still half a prior) is priced nearer 3 rows than the rows it asks for
    assert auto.asking(3)[3] == pytest.approx(auto.cost(3), rel=0.03)
    assert abs(auto.asking(k)[k] - auto.cost(3)) <= abs(auto.asking(k)[k] - auto.cost(k))


def test_the_draft_side_stop_learns_which_confidences_fail():
    """Tokens drafted with low confidence were always rejected, confident ones always kept: the stop
    cuts after a doubtful token and not after a confident one."""
    auto = _controller(_curve(draft_per_token=0.15))
    for _ in range(60):
        auto.acceptance.observe(3, 2, confidence=[0.95, 0.9, 0.15])
    assert auto.choose(budget=100) > 0
    assert auto.keep_drafting(0.95)
    auto.choose(budget=100)
    assert not auto.keep_drafting(0.12)
    # "auto:cost" never consults the draft's confidence
    assert not _controller(_curve(), "cost").wants_confidence


def test_with_the_stop_a_confident_draft_runs_past_the_best_fixed_k():
    """Once the drafter reports its confidence, a speculative step asks for up to K_MAX candidates and
    the draft-side stop sets the length, priced at the best fixed K's rate: confident tokens run past
    that K, a doubtful one ends the proposal. Control: a drafter that never reports confidence gets the
    best fixed K itself."""
    curve = _curve(draft_per_token=0.3)
    for first_confidence, expect_stop_steps in ((None, False), (0.99, True)):
        auto = _controller(curve)
        for _ in range(6):  # confident candidates always kept, a doubtful one (at any position) rejected
            for _ in range(3):
                auto.acceptance.observe(K_MAX, K_MAX, confidence=[0.97] * K_MAX)
            for p in range(1, K_MAX):
                auto.acceptance.observe(p + 1, p, confidence=[0.97] * p + [0.2])
        best = max(range(1, K_MAX + 1), key=auto.rates(100).__getitem__)
        k = auto.choose(budget=100)
        assert k == best and best < K_MAX  # nothing seen yet: the best fixed K
        if first_confidence is not None:
            auto.keep_drafting(first_confidence)
        auto.observe(k, k, 1, 2, 0.3 * k, 1.0, 0.0)  # a whole proposal (a short one would make more K cheap)
        k = auto.choose(budget=100)
        assert (k == K_MAX) is expect_stop_steps, (k, best)
        if expect_stop_steps:
            assert all(auto.keep_drafting(0.97) for _ in range(best + 1))  # past the best fixed K
            assert not auto.keep_drafting(0.2)


def test_a_probe_of_a_drafter_that_does_not_pay_keeps_the_best_fixed_k():
    """Where speculating is not predicted to pay, a probe (or warm-up) step runs the best fixed K's
    length, cut by the stop, not 8 candidates: a draft costing most of a step must not spend 8 draft
    steps finding out (0.93 of a step: K=1 with its first candidate always kept makes 1.026x, short of
    MARGIN). Control: where it pays, the same confident drafter gets 8 (the stop decides)."""
    for draft_cost, pays in ((0.93, False), (0.05, True)):
        auto = _controller(_curve(draft_per_token=draft_cost))
        for _ in range(30):
            auto.acceptance.observe(2, 1, confidence=[0.97, 0.5])
        auto._confidence_seen = True  # the drafter has reported its confidence before
        ks = []
        for _ in range(400):
            k = auto.choose(budget=100)
            ks.append(k)
            if k:
                break
            auto.observe(0, 0, 0, 1, 0.0, 1.0, 0.0)
        assert ks[-1] > 0, "no probe in 400 plain steps"
        assert (ks[-1] == K_MAX) is pays, (draft_cost, ks[-1], len(ks))


@pytest.mark.parametrize("draft_cost, could_pay", [(1.0, False), (0.9, True)])
def test_a_drafter_that_could_not_pay_even_if_every_candidate_were_kept_never_speculates(draft_cost, could_pay):
    """A candidate costing a whole plain step (1.0), verification 0.02 a row: even K + 1 tokens a step
    would not beat plain decoding by MARGIN (K = 8: 9 tokens for 9.16 steps), so warm-up and probes
    could only lose time, and a cold run never speculates in 400 steps. Control: at 0.9 a step (K = 8
    with every candidate kept: 1.07x) the same run warms up and probes."""
    auto = _controller(_curve(draft_per_token=draft_cost), warm=False)
    ks = []
    for step in range(400):
        k = auto.choose(budget=1000 - step)
        ks.append(k)
        auto.observe(k, k, 0, 1, draft_cost * k, 1.0 + 0.02 * k, 0.0)  # every candidate rejected
    if could_pay:
        assert auto.warmup_steps >= 1 and auto.probes >= 2 and sum(k > 0 for k in ks) >= 3
    else:
        assert ks == [0] * 400 and auto.warmup_steps == auto.probes == 0


def _plain_stretch(auto: AutoK, steps: int = 80) -> tuple[list[int], int]:
    """Run ``auto`` as the loop does where no K pays (every probe rejected at once), plain steps taking
    1.1-1.3x the curve; the K chosen at each step, and how often the decision was weighed in full."""
    chance, ks, weighed = random.Random(1), [], 0
    asking = auto.asking

    def counted(*args):
        nonlocal weighed
        weighed += 1
        return asking(*args)

    auto.asking = counted
    for _ in range(60):
        auto.acceptance.observe(4, 0)
    for step in range(steps):
        k = auto.choose(budget=1000 - step)
        ks.append(k)
        auto.observe(k, k, 0, 1, 0.05 * k, chance.uniform(1.1, 1.3) * (1.0 + 0.02 * k), 0.001 * chance.random())
    return ks, weighed


@pytest.mark.parametrize("learning", ["deferred", "dropped"])
def test_a_plain_stretch_weighs_its_decision_every_few_steps_and_learns_from_every_step(monkeypatch, learning):
    """In a plain stretch the full decision runs every PLAIN_RECHECK steps and on the step a probe is due
    (it costs ~40 us with the interpreter's caches cold after a target pass); the steps in between are
    learned from when it runs, in order: the same choices, probes, estimates, prices and predictions as
    weighing every step. Control: deferred steps never learned from (the drift and predictions differ)."""
    weigh_every = _controller(_curve())
    monkeypatch.setattr(adaptive, "PLAIN_RECHECK", 1)
    every_ks, every_weighed = _plain_stretch(weigh_every)
    monkeypatch.setattr(adaptive, "PLAIN_RECHECK", 4)
    fast = _controller(_curve())
    if learning == "dropped":
        monkeypatch.setattr(fast, "_catch_up", lambda: fast._deferred.clear())
    fast_ks, fast_weighed = _plain_stretch(fast)
    assert every_weighed == 80 and fast_weighed <= 80 / 4 + fast.probes + 1, (fast_weighed, fast.probes)
    assert fast.probes >= 3 and 0 in fast_ks
    same = fast_ks == every_ks and all(
        fast.report()[key] == pytest.approx(weigh_every.report()[key], rel=1e-9)
        for key in ("predicted_speedup", "measured_speedup", "acceptance_estimates", "plain_steps", "probes"))
    same = same and fast.verify_scale == pytest.approx(weigh_every.verify_scale, rel=1e-9)
    assert same is (learning == "deferred"), (fast_ks, every_ks, fast.report(), weigh_every.report())


def test_drafts_are_priced_at_the_machine_s_drift_when_a_run_is_mostly_plain():
    """Plain steps that take 1.2x the measured curve (a busier machine) make every draft dearer too,
    although no draft ran: the draft is the same machine's work. Drafts that then run at the curve's
    price (a cheap draft on that machine) bring their own factor back down."""
    curve = _curve(draft_per_token=0.5)
    auto = _controller(curve)
    for _ in range(60):
        auto.observe(0, 0, 0, 1, 0.0, 1.2 * curve.verify[0], 0.0)
    assert auto.cost(4) == pytest.approx(1.2 * (curve.draft[4] + curve.verify[4]), rel=0.01)
    assert auto.verify_scale == pytest.approx(1.2, rel=0.01)  # (plain steps are learned from when priced)
    for _ in range(60):
        auto.observe(4, 4, 0, 1, curve.draft[4], 1.2 * curve.verify[4], 0.0)
    assert auto.cost(4) == pytest.approx(curve.draft[4] + 1.2 * curve.verify[4], rel=0.02)


def _finished_run(curve: CostCurve, kept: bool, steps: int = 40) -> None:
    """One run of the process (digest "pair") that saw every candidate kept, or every one rejected."""
    auto = _controller(curve, warm=False)
    auto._digest = "pair"
    for step in range(steps):
        k = max(1, auto.choose(budget=200 - step))  # speculate every step, to learn
        auto.observe(k, k, k if kept else 0, (k if kept else 0) + 1, 0.45 * k, 1.0 + 0.05 * k, 0.0)
    auto.finish()


@pytest.mark.parametrize("earlier", ["none", "kept", "rejected"])
def test_a_run_starts_from_what_the_process_s_earlier_runs_found(earlier):
    """A draft costing 0.45 of a step: at the prior (acceptance 1/2) a cold run warms up, speculating
    whatever the prediction. After an earlier run of the same target and drafter in this process, the
    next starts from that run's pooled acceptance instead: no warm-up; speculating from its first step
    where earlier runs kept nearly everything, plain where they rejected it (control: no earlier run,
    the warm-up runs)."""
    curve = _curve(draft_per_token=0.45, verify_per_row=0.05)
    if earlier != "none":
        _finished_run(curve, kept=earlier == "kept")
    auto = _controller(curve, warm=False)
    auto._digest = "pair"
    auto._start_from_earlier_runs()
    first = auto.choose(budget=127)
    if earlier == "none":
        assert first > 0 and auto.warmup_steps == 1 and auto.prior_runs_rate is None
    elif earlier == "kept":
        assert first > 0 and auto.warmup_steps == 0 and auto.prior_runs_rate > 0.9
    else:
        assert first == 0 and auto.warmup_steps == 0 and auto.prior_runs_rate < 0.1


@pytest.mark.parametrize("stored", ["kept", "missing", "corrupt", "another key", "pooled only"])
def test_a_new_process_starts_from_what_earlier_processes_found(stored, monkeypatch):
    """Each ``verispec generate`` call is a process of its own: what an earlier process's runs learned is
    kept on disk under the cost key's digest, and a new process's first run starts from it (no warm-up,
    speculating from its first step). Controls: without the file, with a corrupt one, one whose recorded
    digest is another key's, or one in the earlier format (one pooled count, not one per position), the
    run starts from the prior and warms up."""
    curve = _curve(draft_per_token=0.45, verify_per_row=0.05)
    _finished_run(curve, kept=True)  # leaves the file under "pair"
    path = adaptive._learned_file("pair")
    assert path.is_file()
    if stored == "missing":
        path.unlink()
    elif stored == "corrupt":
        path.write_text("{not json")
    elif stored == "another key":  # a file copied or renamed from another key's
        path.write_text(json.dumps({"digest": "other", "kept": [9.0] * K_MAX, "judged": [10.0] * K_MAX}))
    elif stored == "pooled only":  # the earlier format: one pooled count, not one per position
        path.write_text(json.dumps({"digest": "pair", "kept": 9.0, "judged": 10.0}))
    monkeypatch.setattr(adaptive, "_LEARNED", {})  # a new process: nothing in memory
    monkeypatch.setattr(adaptive, "_ROW_COSTS", {})
    auto = _controller(curve, warm=False)
    auto._digest = "pair"
    auto._start_from_earlier_runs()
    first = auto.choose(budget=127)
    assert first > 0
    if stored == "kept":
        assert auto.warmup_steps == 0 and auto.prior_runs_rate > 0.9
    else:
        assert auto.warmup_steps == 1 and auto.prior_runs_rate is None


def test_runs_of_one_process_report_what_earlier_runs_left():
    """Prompt lookup (a draft that costs next to nothing) on a repetitive prompt: the first run judges
    candidates and leaves its pooled acceptance, which the second reports as its prior."""
    target = tiny_model(vocab=16, seed=0)
    run = lambda: verispec.generate(target, input_ids=[1, 2, 3] * 6, max_new_tokens=20,
                                    drafter=verispec.PromptLookup(ngram=1, k="auto")).stats
    first, second = run(), run()
    assert sum(n for k, n in first.k_histogram.items() if k) > 0  # it speculated, so it judged candidates
    assert first.prior_acceptance is None
    assert second.prior_acceptance is not None and 0 <= second.prior_acceptance <= 1


def test_a_step_the_stop_cut_is_predicted_from_its_drafted_confidences():
    """The prediction of a step whose length the stop chose is made from the proposal as drafted: 1 +
    sum of the running products of the acceptance by each candidate's confidence, priced at the rows it
    holds (not at K_MAX's)."""
    curve = _curve(draft_per_token=0.3)
    auto = _controller(curve)
    for _ in range(40):
        auto.acceptance.observe(3, 2, confidence=[0.95, 0.95, 0.15])
    auto.choose(budget=100)
    auto.keep_drafting(0.95)
    auto.observe(1, 1, 1, 2, 0.3, 1.0, 0.0)
    assert auto.choose(budget=100) == K_MAX
    drafted = []
    for c in [0.95, 0.95, 0.15, 0.95]:
        drafted.append(c)
        if not auto.keep_drafting(c):
            break
    proposed = len(drafted)
    assert 2 <= proposed < K_MAX
    expected, reach = 1.0, 1.0
    for c in drafted:
        reach *= auto.acceptance.by_confidence(c)
        expected += reach
    assert auto.acceptance.by_confidence(0.95) > 0.9 and auto.acceptance.by_confidence(0.15) < 0.2
    auto.observe(K_MAX, proposed, 2, 3, curve.draft[proposed], curve.verify[proposed], 0.0)
    tokens, seconds = auto._prediction
    assert tokens == pytest.approx(expected)
    assert seconds == pytest.approx((curve.draft[proposed] * auto.draft_scale + curve.verify[proposed])
                                    * auto.verify_scale, rel=0.2)
    assert seconds < auto.cost(K_MAX) * 0.8


def _rated_controller(verify_per_row: float, draft_per_token: float = 0.0) -> AutoK:
    """A controller that has learned: candidates rated 0.5 are rejected, those rated 0.9 kept."""
    auto = _controller(_curve(verify_per_row=verify_per_row, draft_per_token=draft_per_token))
    for _ in range(60):
        auto.acceptance.observe(3, 2, confidence=[0.9, 0.9, 0.5])
    return auto


def test_the_cut_verifies_the_rated_candidates_that_pay():
    """A proposal known whole and rated (prompt lookup's) is cut to the prefix whose expected tokens
    (P(it and all before it kept)) most exceed what its verified rows cost: a doubtful candidate ends it,
    and a doubtful first one makes the step plain (counted in ``cut_to_plain``; an empty proposal, prompt
    lookup without a match, is not). Control: where a row costs nothing every candidate is kept, the
    doubtful ones too."""
    auto = _rated_controller(verify_per_row=0.3)
    auto.choose(budget=100)
    assert auto.cut([0.9, 0.9, 0.5, 0.9]) == 2
    assert auto.cut([0.9] * 4) == 4
    assert auto.cut([0.5, 0.9, 0.9]) == 0
    assert auto.cut([]) == 0  # nothing to propose (no match): not a proposal cut to nothing
    assert (auto.candidates_cut, auto.cut_to_plain) == (2 + 0 + 3, 1)
    assert auto.report()["candidates_cut"] == 5 and auto.report()["cut_to_plain"] == 1
    free = _rated_controller(verify_per_row=0.0)
    free.choose(budget=100)
    assert free.cut([0.9, 0.9, 0.5, 0.9]) == 4 and free.cut([0.5, 0.9, 0.9]) == 3


def test_the_cut_weighs_the_rows_behind_a_step_up_in_the_curve():
    """The verification curve is not convex (int8 SmolLM2-135M on an AMX Xeon: 4.3, 4.9, 5.9, 6.1, 6.1
    ms for 1-5 rows): where the second row costs a step up and the rows after it are free, one trusted
    candidate does not pay for its row, but four do, and the cut keeps them (stopping at the first
    candidate that does not pay for its own row, it verified none). Control: doubtful candidates behind
    the first do not make the step up pay."""
    auto = _rated_controller(verify_per_row=0.0)
    auto.curve = CostCurve(verify=[1.0] + [1.8] * (adaptive.CURVE_ROWS - 1), draft=[0.0] * (K_MAX + 1))
    auto.choose(budget=100)
    assert auto.cut([0.9]) == 0
    assert auto.cut([0.9] * 4) == 4
    assert auto.cut([0.9, 0.5, 0.5, 0.5]) == 0


def test_a_cheap_rated_drafter_asks_every_step():
    """Rated proposals are cut to what pays, so asking loses at most the draft's seconds: a drafter whose
    proposal costs within MARGIN of a plain step asks on every step, K_MAX candidates, even where its
    acceptance by position says no fixed K pays (well-matched proposals among poor ones). Control: a
    drafter costing 0.1 of a step (over MARGIN) runs plain steps there."""
    for draft_cost, always in ((0.002, True), (0.1 / K_MAX, False)):
        auto = _controller(_curve(verify_per_row=0.3, draft_per_token=draft_cost))
        for _ in range(60):
            auto.acceptance.observe(3, 0, confidence=[0.5])  # poor proposals: no fixed K pays
        auto.choose(budget=100)
        assert auto.cut([0.5, 0.5]) == 0  # a rated proposal seen (in a warm-up step, say), cut to nothing
        auto.observe(2, 0, 0, 1, draft_cost * 2, 1.0, 0.0)
        ks = []
        for _ in range(30):
            k = auto.choose(budget=100)
            ks.append(k)
            kept = auto.cut([0.5, 0.5]) if k else 0
            auto.observe(k, kept, 0, 1, draft_cost * k, 1.0 + 0.3 * kept, 0.0)
        assert all(k == K_MAX for k in ks) is always, ks
        assert (0 in ks) is not always


@pytest.mark.parametrize("probe", [True, False])
def test_proposals_cut_to_nothing_are_probed(probe, monkeypatch):
    """A step cut to nothing judges nothing: estimates that say no candidate pays (a bench warm-up whose
    lookup candidates were all rejected) could never be shown wrong, and a run cut every one of its 127
    proposals where fixed K=2 made 1.18x. After PROBE_FIRST proposals in a row cut to nothing the next
    keeps its first candidate; once those are kept the cut lets the well-rated ones through. Control:
    without the probe (PROBE_FIRST beyond the run) nothing is ever verified."""
    if not probe:
        monkeypatch.setattr(adaptive, "PROBE_FIRST", 10_000)
    auto = _controller(_curve(verify_per_row=0.3, draft_per_token=0.001))
    for _ in range(60):
        auto.acceptance.observe(3, 0, confidence=[0.9])  # learned: well-rated candidates are rejected
    auto._confidence_seen = auto._rated = True  # the drafter has rated its proposals before
    verified = []
    for _ in range(80):  # the text has turned copy-heavy: every candidate would be kept
        k = auto.choose(budget=100)
        kept = auto.cut([0.9] * 4) if k else 0
        verified.append(kept)
        auto.observe(k, kept, kept, kept + 1, 0.001 * k, 1.0 + 0.3 * kept, 0.0)
    if probe:
        assert verified[:adaptive.PROBE_FIRST] == [0] * adaptive.PROBE_FIRST and verified[adaptive.PROBE_FIRST] == 1
        assert auto.probes >= 1 and sum(v > 1 for v in verified[-20:]) >= 15
    else:
        assert sum(verified) == 0


def _passes(auto: AutoK, extra_per_row: float, level: float = 1.0, steps: int = 300) -> None:
    """Feed ``auto`` passes of 1-6 rows that take ``level`` x (the curve's price + ``extra_per_row`` per row
    beyond the first), with +-5% noise."""
    import random

    chance = random.Random(0)
    for _ in range(steps):
        rows = chance.choice([1, 1, 2, 3, 4, 6])
        took = level * (auto.curve.verify_at(rows, 0) + extra_per_row * (rows - 1)) * (1 + 0.05 * chance.gauss(0, 1))
        auto.choose(budget=100)
        auto.observe(rows - 1, rows - 1, 0, 1, 0.0, took, 0.0)


def test_the_run_learns_what_a_verified_row_costs():
    """Passes of more rows take 0.1 step per row beyond the curve's price (the calibration's fastest moment
    flattered them): the controller learns that per-row extra from its own passes and prices each
    further row with it, the level staying verify_scale's. Controls: passes as the curve says teach
    no extra; every pass 1.5x slower is drift (verify_scale), not a per-row cost."""
    curve = _curve(verify_per_row=0.05)
    learns = _controller(curve)
    _passes(learns, extra_per_row=0.1)
    assert 0.07 < learns.row_cost.extra < 0.12, learns.row_cost.extra
    assert learns._price(5, 0) - learns._price(4, 0) == pytest.approx(0.05 + learns.row_cost.extra)
    assert learns.cost(4) - learns.cost(3) == pytest.approx(
        ((curve.draft[4] - curve.draft[3]) * learns.draft_scale + 0.05 + learns.row_cost.extra) * learns.verify_scale)
    assert learns.report()["cost_curve"]["row_extra_seconds"] == pytest.approx(learns.row_cost.extra, abs=1e-6)
    flat = _controller(_curve(verify_per_row=0.05))
    _passes(flat, extra_per_row=0.0)
    assert abs(flat.row_cost.extra) < 0.01
    slower = _controller(_curve(verify_per_row=0.05))
    _passes(slower, extra_per_row=0.0, level=1.5)
    assert abs(slower.row_cost.extra) < 0.015 and slower.verify_scale == pytest.approx(1.5, rel=0.1)


def test_a_run_starts_from_the_row_cost_earlier_runs_found():
    """What a process's earlier run learned of a row's cost starts the next run of that target and drafter
    (at half its weight). Control: another target and drafter (another key) starts from nothing."""
    first = _controller(_curve(verify_per_row=0.05))
    first._digest = "same"
    _passes(first, extra_per_row=0.1)
    first.finish()
    again, other = AutoK(), AutoK()
    again._digest, other._digest = "same", "other"
    again._start_from_earlier_runs()
    other._start_from_earlier_runs()
    assert again.row_cost.extra == pytest.approx(first.row_cost.extra) and other.row_cost.extra == 0.0
    assert again.row_cost.sums[0] == pytest.approx(first.row_cost.sums[0] / 2)


def test_the_draft_curve_is_a_line_one_slow_point_does_not_bend():
    """A proposal costs a fixed part plus one draft step per candidate; the measured points are fitted
    as that line robustly, so one slow measurement (K = 4 here) changes neither the slope the stop
    prices further candidates by nor any other point. Control: a least-squares line leans toward it."""
    line = [0.0] + [10.0 + 20.0 * k for k in range(1, K_MAX + 1)]
    measured = list(line)
    measured[4] += 40.0
    fitted = adaptive.draft_line(measured)
    assert fitted == pytest.approx(line)
    ks = range(1, K_MAX + 1)
    mean_k, mean_d = sum(ks) / len(ks), sum(measured[k] for k in ks) / len(ks)
    slope = sum((k - mean_k) * (measured[k] - mean_d) for k in ks) / sum((k - mean_k) ** 2 for k in ks)
    assert abs(slope - 20.0) > 0.5 or abs(mean_d - slope * mean_k - 10.0) > 2.0


# ---------------------------------------------------------------- exactness with K changing per step

class RedrawsTheCutDraft(verispec.DraftModel):
    """Negative control, wrong only where the draft-side stop cut a proposal after 2+ candidates (a
    later position): the last candidate is redrawn uniformly, while q still says the draft sampled it."""

    def propose(self, context, k):
        proposal = super().propose(context, k)
        tokens = proposal.tokens.clone()
        if 2 <= tokens.numel() < k:
            tokens[-1] = int(torch.randint(0, VOCAB, (1,), generator=context.generator))
        return verispec.Proposal(tokens, proposal.probs, proposal.draft_calls)


def _auto_law_test(monkeypatch, make, sampling: SamplingConfig, n: int = N_SAMPLES):
    """Sample with k="auto" on a synthetic cost curve, the controller's choices half random
    (``_randomize_the_controller``). Returns the p-value and what the runs did."""
    seen = _randomize_the_controller(monkeypatch)
    target = _target()
    counts, _ = sample_with_exercise(target, make, sampling, n)
    return chi_square_pvalue(counts, exact_distribution(target, sampling)), seen


def _randomize_the_controller(monkeypatch) -> dict:
    """k="auto" on a synthetic cost curve; half of the controller's choices (K and the draft-side stop,
    and the cut of rated proposals) are overridden at random, so every K from 0 to the budget and cuts
    at every position occur. Returns what the runs did, filled in as they run."""
    import random

    monkeypatch.setattr(adaptive, "cost_curve", lambda *a: (_curve(verify_per_row=0.05, draft_per_token=0.12), False, "synthetic"))
    chance = random.Random(0)
    seen = {"k": set(), "cut": set(), "deep": 0}
    choose, keep, cut, observe = AutoK.choose, AutoK.keep_drafting, AutoK.cut, AutoK.observe

    def random_choose(self, budget):
        k = choose(self, budget)
        return chance.randint(0, max(0, budget)) if chance.random() < 0.5 else k

    def random_keep(self, confidence):
        go_on = keep(self, confidence)
        return chance.random() < 0.7 if chance.random() < 0.5 else go_on

    def watch(self, asked, proposed, accepted, *rest):
        seen["k"].add(asked)
        if 0 < proposed < asked:
            seen["cut"].add(proposed)
        seen["deep"] += accepted >= 2
        return observe(self, asked, proposed, accepted, *rest)

    def random_cut(self, confidence):
        keep = cut(self, confidence)
        return chance.randint(0, len(confidence)) if chance.random() < 0.5 else keep

    monkeypatch.setattr(AutoK, "choose", random_choose)
    monkeypatch.setattr(AutoK, "keep_drafting", random_keep)
    monkeypatch.setattr(AutoK, "cut", random_cut)
    monkeypatch.setattr(AutoK, "observe", watch)
    return seen


def test_auto_k_preserves_the_target_distribution(monkeypatch):
    draft = TableModel(vocab=VOCAB, seed=99, sharpness=1.5)
    pvalue, seen = _auto_law_test(monkeypatch, lambda: verispec.DraftModel(draft, k="auto"), SamplingConfig(1.0))
    # K took every value the budget allows; proposals were cut after 1, 2 and 3 candidates
    assert seen["k"] == set(range(LENGTH - 1)) and seen["cut"] >= {1, 2, 3} and seen["deep"] > 0, seen
    assert pvalue >= ALPHA, f"k='auto' departs from the target's law (p = {pvalue:.2e})"


class RatedDraft(verispec.DraftModel):
    """A draft model whose proposals come rated (each candidate by q of it), as prompt lookup's do: the
    decoding loop cuts them (``AutoK.cut``), after the draft-side stop has had its say."""

    def propose(self, context, k):
        proposal = super().propose(context, k)
        rated = [float(q[t]) for q, t in zip(proposal.probs, proposal.tokens.tolist())] if proposal.probs is not None else None
        return dataclasses.replace(proposal, confidence=rated)


def test_cut_proposals_keep_the_target_distribution(monkeypatch):
    """Rated proposals cut at every position keep the target's law: the tokens kept and their q agree."""
    draft = TableModel(vocab=VOCAB, seed=99, sharpness=1.5)
    pvalue, seen = _auto_law_test(monkeypatch, lambda: RatedDraft(draft, k="auto"), SamplingConfig(1.0))
    assert seen["cut"] >= {1, 2, 3} and seen["deep"] > 0, seen
    assert pvalue >= ALPHA, f"cutting rated proposals departs from the target's law (p = {pvalue:.2e})"


def test_cut_negative_control_is_detected(monkeypatch):
    """Negative control, wrong only at later positions of a proposal through the cut: each kept candidate
    after the first is paired with the q of the one before it (an off-by-one in the cut)."""
    prefix = verispec.Proposal.prefix

    def off_by_one(self, n):
        out = prefix(self, n)
        if n >= 2 and self.probs is not None:
            probs = out.probs.clone()
            probs[1:n] = self.probs[:n - 1]
            out = dataclasses.replace(out, probs=probs)
        return out

    monkeypatch.setattr(verispec.Proposal, "prefix", off_by_one)
    draft = TableModel(vocab=VOCAB, seed=99, sharpness=1.5)
    pvalue, seen = _auto_law_test(monkeypatch, lambda: RatedDraft(draft, k="auto"), SamplingConfig(1.0))
    assert seen["cut"] >= {2, 3}, seen
    assert pvalue < ALPHA, f"a cut pairing later candidates with the wrong q went undetected (p = {pvalue:.3f})"


def test_auto_k_negative_control_is_detected(monkeypatch):
    draft = TableModel(vocab=VOCAB, seed=99, sharpness=1.5)
    # Its defect touches only the steps where the stop cut a proposal after 2+ candidates: twice the
    # samples, for the power to see it (at N_SAMPLES its p-value sat near ALPHA, 1.5e-3 on one stream)
    pvalue, seen = _auto_law_test(monkeypatch, lambda: RedrawsTheCutDraft(draft, k="auto"), SamplingConfig(1.0),
                                  n=2 * N_SAMPLES)
    assert seen["cut"] >= {2, 3}, seen
    assert pvalue < ALPHA, f"redrawing cut proposals' last draft went undetected (p = {pvalue:.3f})"


def test_sampled_prompt_lookup_with_auto_commits_the_tokens_plain_sampling_commits(monkeypatch):
    """Position-keyed sampling: with K and the cut changing from step to step (half at random), prompt
    lookup's sampled output is token for token plain sampling's with the same seed."""
    seen = _randomize_the_controller(monkeypatch)
    target, prompt = _target(), [1, 2, 0, 1, 2, 0, 1]
    differing, judged = against_plain(target, lambda: verispec.PromptLookup(ngram=1, k="auto"),
                                      SamplingConfig(0.7, top_p=0.95), prompt=prompt, length=16)
    assert len(seen["k"]) >= 5 and seen["cut"] >= {1, 2, 3}, seen
    assert judged["rejected_later"] > 0 and judged["all_kept"] > 0, judged
    assert differing == 0, f"{differing} seeds gave other tokens than plain sampling"


@pytest.mark.parametrize("mode", ["auto", "auto:cost", "auto:confidence"])
def test_greedy_auto_equals_plain_greedy_for_every_drafter(mode):
    target = tiny_model(vocab=16, seed=0, layers=3)
    draft = tiny_model(vocab=16, seed=1, layers=1)
    drafters = [verispec.DraftModel(draft, k=mode), verispec.LayerSkip([1], k=mode), verispec.EarlyExit(1, k=mode),
                verispec.LowRank(rank=4, k=mode), verispec.PromptLookup(ngram=2, k=mode),
                verispec.QuantizedDraft(8, k=mode)]
    for prompt in ([1, 5, 9], [3, 3, 3, 3, 2, 3, 3]):
        plain = verispec.generate(target, input_ids=prompt, max_new_tokens=30).token_ids
        for drafter in drafters:
            result = verispec.generate(target, input_ids=prompt, max_new_tokens=30, drafter=drafter)
            assert result.token_ids == plain, drafter.method
            s = result.stats
            assert sum(s.k_histogram.values()) == s.decode_steps and s.k == mode
            assert s.cost_curve is not None and len(s.cost_curve["verify_seconds"]) == adaptive.CURVE_ROWS
            assert s.predicted_speedup > 0 and s.measured_speedup > 0 and s.plain_steps == s.k_histogram.get(0, 0)


def test_every_drafter_defaults_to_auto_unless_k_or_a_tuned_file_says_otherwise(tmp_path):
    from verispec.cli import main
    from verispec.drafters.registry import make_choice

    target = tiny_model(vocab=16, seed=0, layers=3)
    draft = tiny_model(vocab=16, seed=1, layers=1)
    defaults = [verispec.DraftModel(draft), verispec.LayerSkip([1]), verispec.EarlyExit(1), verispec.LowRank(rank=4),
                verispec.PromptLookup(ngram=2), verispec.QuantizedDraft(8)]
    assert [d.k for d in defaults] == ["auto"] * 6
    assert make_choice("prompt-lookup").k == make_choice("draft-model", {"draft": "d"}).k == "auto"
    listing = CliRunner().invoke(main, ["drafters"]).output
    assert listing.count("(default K = auto)") == len(verispec.drafters.DRAFTERS), listing
    tuned = tmp_path / "skip.json"
    tuned.write_text(json.dumps({"method": "layer-skip", "skip": [1], "k": 3}))
    assert verispec.LayerSkip(str(tuned)).k == 3 and verispec.LayerSkip(str(tuned), k=2).k == 2
    tuned.write_text(json.dumps({"method": "layer-skip", "skip": [1]}))
    assert verispec.LayerSkip(str(tuned)).k == "auto"
    plain = verispec.generate(target, input_ids=[1, 5, 9], max_new_tokens=20).token_ids
    result = verispec.generate(target, input_ids=[1, 5, 9], max_new_tokens=20, drafter=verispec.LayerSkip([1]))
    assert result.token_ids == plain and result.stats.k == "auto" and result.stats.predicted_speedup is not None


def test_costs_are_measured_once_per_process():
    target, draft = tiny_model(vocab=16, seed=0), tiny_model(vocab=16, seed=1, layers=1)
    run = lambda: verispec.generate(target, input_ids=[1, 2], max_new_tokens=20, sampling=SamplingConfig(1.0, seed=11),
                                    drafter=verispec.DraftModel(draft, k="auto")).stats
    assert run().calibration_seconds > 0
    assert run().calibration_seconds == 0


def test_the_curve_prices_judging_every_row():
    """The calibration times each verification with its rows judged as the loop judges them (at T = 0.7
    the sampling transform over the vocabulary costs per row what a small model's pass barely shows):
    a judge costing 5 ms a row makes every further row about 5 ms dearer. Control: without the judge
    the tiny model's extra rows cost a fraction of that (margins wide enough for a loaded machine)."""
    import time as clock

    target = tiny_model(vocab=16, seed=0, layers=1)
    seen = []

    def judge(drafts, probs, logits):
        seen.append((drafts.numel(), logits.shape[0]))
        clock.sleep(0.005 * logits.shape[0])

    slopes = {}
    for name, j in (("judged", judge), ("alone", None)):
        context = _run_context(target, [1, 2, 3, 4])
        curve = adaptive.measure(target, verispec.PromptLookup(ngram=1, k="auto"), context, j)
        slopes[name] = (curve.verify[8] - curve.verify[0]) / 8
    assert slopes["judged"] - slopes["alone"] > 0.004 and slopes["alone"] < 0.5 * slopes["judged"], slopes
    assert {rows for _, rows in seen} == set(range(1, adaptive.CURVE_ROWS + 1))
    assert all(drafts == rows - 1 for drafts, rows in seen)


def _run_context(model, prompt, room: int = 40):
    """The loop's state after the prefill of ``prompt``: the context a drafter and the controller see."""
    from verispec.drafters.base import DraftContext

    cache = model.new_cache(len(prompt) + room)
    logits = model.forward(torch.tensor(prompt), cache, 0, last_only=True)
    tokens = list(prompt) + [int(logits[-1].argmax())]
    return DraftContext(tokens, model, cache, SamplingConfig(), torch.Generator().manual_seed(0))


def test_a_curve_timed_with_little_room_is_timed_again_where_a_run_has_more():
    """A cache with room for 6 more positions times passes of 1..6 rows and extrapolates the rest (the
    bench's 8-token warm-up priced SmolLM2's 7-16-row passes at +0.2 ms a row where they cost ~9 ms, and
    every later run read that curve): the curve says so, and the next run with room times it whole and
    replaces it; a short run after that reuses the whole one."""
    target = tiny_model(vocab=16, seed=0, layers=1)
    drafter = verispec.PromptLookup(ngram=1, k="auto")
    short, measured, digest = adaptive.cost_curve(target, drafter, _run_context(target, [1, 2, 3, 4], room=6))
    assert measured and short.measured_rows == 6
    whole, measured, _ = adaptive.cost_curve(target, drafter, _run_context(target, [1, 2, 3, 4], room=40))
    assert measured and whole.measured_rows == adaptive.CURVE_ROWS
    stored = json.loads((adaptive.cache_dir() / "costs" / f"{digest}.json").read_text())
    assert stored["curve"]["measured_rows"] == adaptive.CURVE_ROWS
    again, measured, _ = adaptive.cost_curve(target, drafter, _run_context(target, [1, 2, 3, 4], room=6))
    assert not measured and again.measured_rows == adaptive.CURVE_ROWS


def test_a_short_auto_run_times_the_whole_curve():
    """A run of 4 new tokens writes at most 3 positions past its prompt, yet its calibration times passes of
    up to CURVE_ROWS rows: the run's cache has room for them (and the output is plain greedy's)."""
    target, draft = tiny_model(vocab=16, seed=0, layers=2), tiny_model(vocab=16, seed=1, layers=1)
    result = verispec.generate(target, input_ids=[1, 2, 3], max_new_tokens=4, drafter=verispec.DraftModel(draft, k="auto"))
    assert result.stats.cost_curve["measured_rows"] == adaptive.CURVE_ROWS
    assert result.token_ids == verispec.generate(target, input_ids=[1, 2, 3], max_new_tokens=4).token_ids


def test_judging_the_calibration_leaves_the_run_s_random_stream_alone(monkeypatch):
    """The calibration judges its passes on a generator of its own: a sampled k="auto" run that measures
    its cost curve draws what the same run draws with the curve already measured (no calibration), and
    one that never speculates draws what plain sampling with its seed draws. Control: judging on the
    run's own generator (the rejection sampling draws from it) changes the run's tokens."""
    from verispec.decoding import Generation

    target, draft = tiny_model(vocab=16, seed=0, layers=2), tiny_model(vocab=16, seed=1, layers=1)
    sampling = SamplingConfig(1.0, seed=5)
    run = lambda: verispec.generate(target, input_ids=[1, 2, 3], max_new_tokens=24, sampling=sampling,
                                    drafter=verispec.DraftModel(draft, k="auto")).token_ids
    fresh = lambda name: (monkeypatch.setattr(adaptive, "_MEASURED", {}),
                          monkeypatch.setenv("VERISPEC_CACHE", str(adaptive.cache_dir() / name)))
    monkeypatch.setattr(AutoK, "choose", lambda self, budget: min(2, budget))  # speculates every step
    fresh("first")
    calibrated = run()
    assert adaptive._MEASURED  # the curve it measured: the next run reads it and calibrates nothing
    assert run() == calibrated
    monkeypatch.setattr(AutoK, "choose", lambda self, budget: 0)  # never speculates
    fresh("second")
    plain = verispec.generate(target, input_ids=[1, 2, 3], max_new_tokens=24, sampling=sampling).token_ids
    assert run() == plain
    verify = Generation._verify
    monkeypatch.setattr(Generation, "_verify", lambda self, d, q, logits, generator=None: verify(self, d, q, logits))
    monkeypatch.setattr(AutoK, "choose", lambda self, budget: min(2, budget))
    fresh("third")
    assert run() != calibrated


def test_greedy_and_sampled_judging_are_priced_apart():
    """Greedy judging is an argmax, sampled judging the transform over the vocabulary (top-k and top-p add
    a selection or a sort): each has its own cost curve."""
    kinds = {adaptive.judging(s) for s in (SamplingConfig(), SamplingConfig(0.7), SamplingConfig(0.7, top_k=20),
                                           SamplingConfig(0.7, top_p=0.9), SamplingConfig(1.0, top_k=5, top_p=0.5))}
    assert kinds == {"greedy", "sampled", "sampled+top_k", "sampled+top_p", "sampled+top_k+top_p"}


# ---------------------------------------------------------------- the cache and bad input

def test_the_disk_cache_is_keyed_by_machine_and_rebuilt_when_wrong(tiny_llama, monkeypatch, caplog):
    model = verispec.load_model(str(tiny_llama))
    drafter = lambda: verispec.LayerSkip([1], k="auto")
    verispec.generate(model, input_ids=[1, 2, 3], max_new_tokens=12, drafter=drafter())
    files = [f for f in (adaptive.cache_dir() / "costs").glob("*.json") if not f.name.endswith(".learned.json")]
    assert len(files) == 1 and not list(files[0].parent.glob("*.tmp*"))  # one curve (and what the run learned)
    stored = json.loads(files[0].read_text())
    assert stored["key"]["machine"]["cpu"] and stored["key"]["machine"]["torch"] == torch.__version__

    def fresh_run():
        monkeypatch.setattr(adaptive, "_MEASURED", {})
        return verispec.generate(model, input_ids=[1, 2, 3], max_new_tokens=12, drafter=drafter()).stats

    assert fresh_run().calibration_seconds == 0  # read from disk
    stored["key"]["machine"]["cpu"] = "another CPU"
    files[0].write_text(json.dumps(stored))
    with caplog.at_level(logging.INFO, logger="verispec.adaptive"):
        assert fresh_run().calibration_seconds > 0
    assert "another machine or version" in caplog.text
    files[0].write_text("{not json")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="verispec.adaptive"):
        assert fresh_run().calibration_seconds > 0
    assert "unreadable" in caplog.text
    assert json.loads(files[0].read_text())["curve"]["verify"]  # rewritten whole


def test_costs_measured_with_other_int8_paths_are_not_reused(monkeypatch):
    if not kernels.available():
        pytest.skip("no compiled kernels: one runtime only")
    monkeypatch.setitem(kernels._state, "int8_table", ["vnni"] * len(kernels.ROW_COUNTS))
    on_vnni = adaptive.machine()
    monkeypatch.setitem(kernels._state, "int8_table", ["amx"] * len(kernels.ROW_COUNTS))
    assert adaptive.machine() != on_vnni  # a verification curve measured on VNNI is wrong for AMX tiles


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "fast", "auto:greedy", "", None])
def test_bad_k_is_a_clear_error(bad):
    with pytest.raises(VerispecError, match="positive integer or 'auto'"):
        parse_k(bad)
    with pytest.raises(VerispecError, match="positive integer or 'auto'"):
        verispec.PromptLookup(k=bad)


def test_k_auto_spellings():
    assert parse_k("auto") == "auto" and parse_k(" AUTO ") == "auto" and parse_k("auto:cost") == "auto:cost"
    assert parse_k("3") == 3 and parse_k(8) == 8


def test_a_drafter_failing_while_measured_falls_back_to_plain(caplog):
    class Broken(verispec.DrafterBase):
        method = "broken"
        calls = 0

        def propose(self, context, k):
            raise RuntimeError("the draft device went away")

    target = tiny_model(vocab=16, seed=0)
    with caplog.at_level(logging.WARNING, logger="verispec.adaptive"):
        result = verispec.generate(target, input_ids=[1, 2], max_new_tokens=10, drafter=Broken("auto"))
    assert "decoding without speculation" in caplog.text
    assert result.token_ids == verispec.generate(target, input_ids=[1, 2], max_new_tokens=10).token_ids
    assert result.stats.k_histogram == {0: 9} and "the draft device went away" in result.stats.settings["auto_fallback"]


def test_cli_takes_k_auto_and_refuses_nonsense(tiny_chat_pair):
    from verispec.cli import main

    runner, folder = CliRunner(), str(tiny_chat_pair[0])
    ok = runner.invoke(main, ["generate", "x", "--model", folder, "--layer-skip", "1", "-k", "auto", "-n", "8", "--json"])
    assert ok.exit_code == 0, ok.output
    stats = json.loads(ok.output)["stats"]
    assert stats["k"] == "auto" and stats["cost_curve"] and stats["predicted_speedup"]
    bad = runner.invoke(main, ["generate", "x", "--model", folder, "--layer-skip", "1", "-k", "many"])
    assert bad.exit_code != 0 and "positive integer or 'auto'" in bad.output and "Traceback" not in bad.output


# ---------------------------------------------------------------- the replay benchmark

def _replay_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "auto_k_replay.py"
    spec = importlib.util.spec_from_file_location("auto_k_replay", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("make", [lambda d: verispec.DraftModel(d, k=2), lambda d: verispec.PromptLookup(2, k=2)])
def test_replay_takes_the_steps_a_real_greedy_run_takes(make):
    """benchmarks/auto_k_replay.py prices policies on a recording of the drafter's proposals; a fixed K
    replayed must commit exactly what a real run commits, step by step, or its modelled times mean
    nothing. Control: proposals recorded one position late (the misalignment the recording could
    have) no longer reproduce the run."""
    replay = _replay_module()
    target = tiny_model(vocab=16, seed=0, layers=3)
    draft = tiny_model(vocab=16, seed=1, layers=1)
    prompt = [3, 3, 3, 3, 2, 3, 3]
    curve: list = []
    rec = replay.record_prompt(target, make(draft), prompt, 40, curve)
    assert rec["output"] == verispec.generate(target, input_ids=prompt, max_new_tokens=40).token_ids
    for k in (1, 2, 3, 5):
        drafter = make(draft)
        drafter.k = k
        stats = verispec.generate(target, input_ids=prompt, max_new_tokens=40, drafter=drafter).stats
        modelled = replay.replay(rec, curve[0], k)
        assert sum(modelled["k_histogram"].values()) == stats.decode_steps
        assert modelled["accepted"] == stats.accepted_tokens
    late = dict(rec, proposals=rec["proposals"][1:] + [[]])
    stats = verispec.generate(target, input_ids=prompt, max_new_tokens=40, drafter=make(draft)).stats
    assert replay.replay(late, curve[0], 2)["accepted"] != stats.accepted_tokens


@pytest.mark.parametrize("steady", [True, False])
def test_one_rejection_after_earlier_runs_kept_nearly_everything_does_not_stop_speculation(steady, monkeypatch):
    """A draft costing 0.45 of a step, verified rows 0.15 each (a quantized self-draft on a 790-token
    prompt): earlier runs of the process kept nearly every candidate, and this run's first candidate is
    rejected. The recent estimate of the first position falls to ~0.55, below what pays; the steadier
    one (STEADY_WEIGHT pseudo-observations of the pooled rate) stays above, so the run goes on
    speculating, as a real run on Spec-Bench rag 483 should have (it went plain for 39 of 71 steps).
    Negative control: deciding on the recent estimate alone (the weight of PRIOR_WEIGHT) goes plain."""
    if not steady:
        monkeypatch.setattr(adaptive, "STEADY_WEIGHT", adaptive.PRIOR_WEIGHT)
    curve = _curve(draft_per_token=0.45, verify_per_row=0.15)
    _finished_run(curve, kept=True)
    auto = _controller(curve, warm=False)
    auto._digest = "pair"
    auto._start_from_earlier_runs()
    k = auto.choose(budget=127)
    assert k > 0
    auto.observe(k, k, 0, 1, 0.45 * k, 1.0 + 0.15 * k, 0.0)  # the first candidate rejected
    assert auto.acceptance.alphas()[0] < 0.6 < auto.acceptance.pooled
    ks = []
    for step in range(10):
        k = auto.choose(budget=126 - step)
        ks.append(k)
        auto.observe(k, k, k, k + 1, 0.45 * k, 1.0 + 0.15 * k, 0.0)  # the rest kept
    assert all(k > 0 for k in ks) if steady else ks[0] == 0


def _rejected_steps_before_plain(monkeypatch, weight: float) -> int:
    """Steps a run speculates into a stretch where every candidate is rejected, after 40 steps that kept
    everything (the draft and rows of the test above), deciding with ``weight`` toward the pooled rate."""
    monkeypatch.setattr(adaptive, "STEADY_WEIGHT", weight)
    auto = _controller(_curve(draft_per_token=0.45, verify_per_row=0.15))
    for _ in range(40):
        auto.acceptance.observe(2, 2)
    for step in range(60):
        k = auto.choose(budget=1000)
        if k == 0:
            return step
        auto.observe(k, k, 0, 1, 0.45 * k, 1.0 + 0.15 * k, 0.0)
    return 60


def test_a_stretch_of_rejections_still_stops_speculation(monkeypatch):
    """The steadier estimate does not carry a run through a stretch of rejections: it goes plain within
    two steps of where the recent estimate alone would (9 rejected steps after 40 kept ones). Negative
    control: a weight of 100 toward the pooled rate speculates through twice as many."""
    recent = _rejected_steps_before_plain(monkeypatch, adaptive.PRIOR_WEIGHT)
    assert 0 < _rejected_steps_before_plain(monkeypatch, adaptive.STEADY_WEIGHT) <= recent + 2
    assert _rejected_steps_before_plain(monkeypatch, 100.0) > recent + 2


def _rated_stretch(auto: AutoK, steps: int = 130, dear_from: int = 30) -> tuple[list[int], list[int]]:
    """Run ``auto`` as the loop does for a rated drafter (prompt lookup: proposals whole, rated, ``cut``):
    its proposals cost next to nothing until step ``dear_from``, then a whole plain step each and every
    candidate is rejected (a drafter whose price changed on text it cannot predict), so asking stops
    paying. The K asked at each step, and the steps whose decision was weighed in full."""
    chance, ks, weighed = random.Random(2), [], []
    asking = auto.asking

    def counted(*args):
        weighed.append(len(ks))
        return asking(*args)

    auto.asking = counted
    for _ in range(20):
        auto.acceptance.observe(4, 2, confidence=[0.9, 0.9, 0.5, 0.3])
    for step in range(steps):
        k = auto.choose(budget=1000 - step)
        ks.append(k)
        keep = auto.cut([0.9, 0.9, 0.5, 0.3]) if k else 0
        accepted = min(keep, chance.choice([0, 1, 2, 2])) if step < dear_from else 0
        draft = (0.005 if step < dear_from else 1.0) if k else 0.0
        auto.observe(k, keep, accepted, accepted + 1, draft, 1.0 + 0.02 * keep, 0.001)
    return ks, weighed


@pytest.mark.parametrize("reweighs", [True, False])
def test_a_rated_drafter_asks_without_weighing_for_a_few_steps_and_stops_when_asking_stops_paying(monkeypatch, reweighs):
    """Prompt lookup's steps ask for K_MAX while its proposals cost next to nothing (the cut keeps what
    pays); the full decision is weighed every PLAIN_RECHECK steps, not every step. When the proposals
    turn dear, the run stops asking at most PLAIN_RECHECK - 1 steps after a controller weighing every
    step. Control: a stretch that is never weighed again keeps asking, and fails."""
    monkeypatch.setattr(adaptive, "PLAIN_RECHECK", 1)
    every = _controller(_curve(draft_per_token=0.001))
    every_ks, every_weighed = _rated_stretch(every)
    monkeypatch.setattr(adaptive, "PLAIN_RECHECK", 4)
    fast = _controller(_curve(draft_per_token=0.001))
    if not reweighs:
        choose = fast.choose

        def never_again(budget):
            k = choose(budget)
            fast._ask_ahead = 10**6 if fast._ask_ahead else 0
            return k
        monkeypatch.setattr(fast, "choose", never_again)
    fast_ks, fast_weighed = _rated_stretch(fast)
    stopped = every_ks.index(0)  # the reference's first step without asking
    assert 30 < stopped < 120 and set(every_ks[1:stopped]) == {K_MAX}  # (the first step: before any rating)
    assert fast_ks[:stopped] == every_ks[:stopped]
    assert len(set(every_weighed) & set(range(stopped))) == stopped
    assert len(set(fast_weighed) & set(range(stopped))) <= stopped / adaptive.PLAIN_RECHECK + 2
    caught_up = 0 in fast_ks[stopped:stopped + adaptive.PLAIN_RECHECK]
    assert caught_up is reweighs, (fast_ks, every_ks)
