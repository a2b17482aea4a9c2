"""The sampling transform against hand-computed distributions, and bad inputs."""

from __future__ import annotations

import math

import pytest
import torch

from verispec.errors import VerispecError
from verispec.sampling import SamplingConfig, check_logits, logits_to_probs

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0])


def softmax(values):
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


def test_greedy_is_one_hot_on_argmax():
    assert logits_to_probs(LOGITS, SamplingConfig()).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_temperature():
    got = logits_to_probs(LOGITS, SamplingConfig(temperature=0.5))
    assert torch.allclose(got, torch.tensor(softmax([4.0, 2.0, 0.0, -2.0])), atol=1e-6)


def test_top_k_renormalises():
    got = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, top_k=2))
    expected = softmax([2.0, 1.0]) + [0.0, 0.0]
    assert torch.allclose(got, torch.tensor(expected), atol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_p():
    full = softmax([2.0, 1.0, 0.0, -1.0])  # ~[0.644, 0.237, 0.087, 0.032]
    got = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, top_p=0.85))  # 0.644 < 0.85 <= 0.881
    expected = [full[0] / (full[0] + full[1]), full[1] / (full[0] + full[1]), 0.0, 0.0]
    assert torch.allclose(got, torch.tensor(expected), atol=1e-6)
    only_first = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, top_p=0.1))
    assert only_first.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_top_k_then_top_p_on_a_batch():
    batch = torch.stack([LOGITS, LOGITS.flip(0)])
    got = logits_to_probs(batch, SamplingConfig(temperature=1.0, top_k=3, top_p=0.8))
    assert torch.allclose(got.sum(-1), torch.ones(2))
    assert got[0, 3] == 0 and got[1, 0] == 0


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": -3}, "seed"),
])
def test_bad_values_are_rejected(kwargs, message):
    with pytest.raises(VerispecError, match=message):
        SamplingConfig(**kwargs)


def test_check_logits_refuses_what_no_distribution_comes_from_and_keeps_masks_and_huge_finite_rows():
    """The one-reduction fast path (a row sum) must not let a bad entry through at any row, nor refuse
    a -inf mask or finite logits whose sum overflows."""
    good = torch.randn(9, 4096)
    check_logits(good, "t")
    masked = good.clone()
    masked[4, :100] = -math.inf
    check_logits(masked, "t")  # -inf alone is a mask
    huge = torch.full((3, 4096), 3e38)  # every entry finite, the row sums overflow to inf
    check_logits(huge, "t")
    for row in (0, 5, 8):
        for value, where in ((math.nan, 7), (math.inf, 4095), (-math.inf, None)):
            bad = good.clone()
            if where is None:
                bad[row] = -math.inf  # a row with no finite entry
            else:
                bad[row, where] = value
            with pytest.raises(VerispecError, match="non-finite logits"):
                check_logits(bad, "t")
    opposite = good.clone()
    opposite[6, 1], opposite[6, 2] = math.inf, -math.inf  # +inf hidden in a NaN sum
    with pytest.raises(VerispecError, match="non-finite logits"):
        check_logits(opposite, "t")
