"""A prompt's attention on AMX bf16 tiles (kernels/prompt_attention.cpp): bf16x3 products, fp32 softmax.

It must be about as accurate as fp32 attention (each fp32 product taken as three bf16 ones: far closer
than bf16 attention), causal at every position (no row sees a later key), and taken by both the compiled
layer stack and the Python path, so a prompt gives the same bits either way.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import missing_setup
from verispec import kernels
from verispec.testing import tiny_model

# Largest error against fp64 allowed of the tiles: measured 5-7e-5 on inputs like these (torch's fp32
# attention: 2-7e-6; its bf16 attention: 2.5-3.6e-2, which the control below must fail).
TOLERANCE = 3e-4


@pytest.fixture(scope="module")
def module():
    if not kernels.available():
        missing_setup("verispec's kernels are not available here (no AVX2, no compiler, or VERISPEC_KERNELS=0)")
    module = kernels._load()
    if not module.prompt_attention_supported(64):
        pytest.skip("this CPU has no AMX-BF16 tiles: prompts' attention runs on torch's fp32 kernel (tested elsewhere)")
    return module


def _inputs(H, KV, T, D, start, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, T, D, generator=g) * D ** -0.5 * spread
    # a cache longer than the pass (keys past start + T must not be read)
    keys, values = torch.randn(KV, start + T + 9, D, generator=g), torch.randn(KV, start + T + 9, D, generator=g)
    return q, keys[:, :start + T], values[:, :start + T]


def _torch(q, keys, values, start, dtype):
    H, T, D = q.shape
    mask = torch.ones(T, start + T, dtype=torch.bool).tril(start)
    out = F.scaled_dot_product_attention(q[None].to(dtype), keys[None].to(dtype), values[None].to(dtype),
                                         attn_mask=mask, scale=1.0, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(T, H * D).double()


@pytest.mark.parametrize("H,KV,T,D,start", [(12, 2, 703, 128, 0), (9, 3, 200, 64, 0), (12, 2, 100, 128, 37),
                                            (4, 4, 67, 32, 5), (6, 2, 81, 64, 300)])
def test_prompt_attention_is_about_as_accurate_as_fp32(module, H, KV, T, D, start):
    q, keys, values = _inputs(H, KV, T, D, start, seed=T + D)
    exact = _torch(q.double(), keys.double(), values.double(), start, torch.float64)
    error = (module.prompt_attention(q, keys, values, start).double() - exact).abs().max().item()
    assert error < TOLERANCE
    # control: the tolerance is far tighter than attention in plain bf16
    assert (_torch(q, keys, values, start, torch.bfloat16) - exact).abs().max().item() > 10 * TOLERANCE


def test_prompt_attention_stays_accurate_with_large_scores(module):
    q, keys, values = _inputs(6, 2, 90, 64, 4, seed=5, spread=60.0)  # scores in the hundreds: most e^(s - max) = 0
    exact = _torch(q.double(), keys.double(), values.double(), 4, torch.float64)
    out = module.prompt_attention(q, keys, values, 4)
    assert torch.isfinite(out).all()
    # one bf16x3 score error (~2^-16 of |q||k|) moves probabilities by that much times the score's size
    assert (out.double() - exact).abs().max().item() < 100 * TOLERANCE


@pytest.mark.parametrize("position", [0, 31, 32, 50, 95])  # first key, the edges of 32-key blocks, later ones
def test_no_row_sees_a_later_key(module, position):
    H, KV, T, D, start = 6, 2, 96, 64, 0
    q, keys, values = _inputs(H, KV, T, D, start, seed=1)
    before = module.prompt_attention(q, keys, values, start)
    keys, values = keys.clone(), values.clone()
    keys[:, position] += 5.0
    values[:, position] -= 7.0
    after = module.prompt_attention(q, keys, values, start)
    # rows before the changed position are the same bits; the row at it and every later row change
    assert torch.equal(before[:position], after[:position])
    changed = (before[position:] != after[position:]).any(dim=1)
    assert changed.all(), changed.nonzero()


def test_grouped_heads_use_their_own_kv_head(module):
    H, KV, T, D = 6, 3, 70, 32
    q, keys, values = _inputs(H, KV, T, D, 0, seed=2)
    out = module.prompt_attention(q, keys, values, 0)
    values = values.clone()
    values[1] += 1.0  # KV head 1 serves query heads 2 and 3
    moved = (module.prompt_attention(q, keys, values, 0) - out).view(T, H, D).abs().amax(dim=(0, 2))
    assert (moved[[2, 3]] > 0.5).all() and (moved[[0, 1, 4, 5]] == 0).all()


def test_a_prompt_takes_the_tiles_in_the_stack_and_the_python_path(module, monkeypatch):
    model = tiny_model(vocab=50, seed=3, layers=3, hidden=64, context=256)  # head size 32: tiles apply
    tokens = torch.randint(0, 50, (120,), generator=torch.Generator().manual_seed(0))
    runs = {}
    for fused in ("1", "0"):
        for tiles in ("1", "0"):
            monkeypatch.setenv("VERISPEC_FUSED_LAYERS", fused)
            monkeypatch.setenv("VERISPEC_TILE_ATTENTION", tiles)
            runs[fused, tiles] = model.forward(tokens, model.new_cache(120), 0)
    assert torch.equal(runs["1", "1"], runs["0", "1"])  # the same bits on both paths
    assert torch.equal(runs["1", "0"], runs["0", "0"])
    # the switch really changed the kernel (bits differ), and both are fp32-close
    assert not torch.equal(runs["1", "1"], runs["1", "0"])
    assert (runs["1", "1"] - runs["1", "0"]).abs().max() < 1e-3


def test_bad_inputs_are_refused(module):
    q, keys, values = _inputs(4, 2, 70, 64, 0)
    with pytest.raises(RuntimeError, match="keys/values"):
        module.prompt_attention(q, keys[:, :50], values[:, :50], 0)  # fewer keys than positions
    with pytest.raises(RuntimeError, match="fp32"):
        module.prompt_attention(q.double(), keys, values, 0)
    assert not module.prompt_attention_supported(48)  # head size not in 32s: torch's attention
