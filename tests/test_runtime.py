"""The native runtime against transformers, and the KV cache's O(1) rollback."""

from __future__ import annotations

import pytest
import torch

from verispec.models.hf_backend import HFModel
from verispec.models.loading import load_model, load_native


def _reference(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _check_against_transformers(folder, tol=1e-4, prompt_len=7, steps=(1, 3, 4)):
    native = load_native(folder, torch.float32)
    reference = _reference(folder)
    vocab = native.config.vocab_size
    ids = torch.randint(0, vocab, (prompt_len + sum(steps),), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids.view(1, -1)).logits[0]  # [T, vocab]
    cache = native.new_cache(ids.numel())
    got = [native.forward(ids[:prompt_len], cache, 0)]  # prefill
    pos = prompt_len
    for step in steps:  # multi-token steps on a cache, as verification does
        got.append(native.forward(ids[pos:pos + step], cache, pos))
        pos += step
    diff = (torch.cat(got) - expected).abs().max().item()
    assert diff <= tol, f"max abs logit difference {diff}"


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
def test_native_matches_transformers(fixture, request):
    _check_against_transformers(request.getfixturevalue(fixture))


def test_mistral_matches_transformers_and_guards_its_sliding_window(tmp_path):
    from tests.conftest import build_tiny_checkpoint
    from verispec.errors import VerispecError

    folder = build_tiny_checkpoint(tmp_path, "mistral", seed=4)
    _check_against_transformers(folder)
    with pytest.raises(VerispecError, match="sliding attention window"):
        load_native(folder, torch.float32).new_cache(200)


def test_tied_embeddings_and_llama3_rope(tmp_path):
    from tests.conftest import build_tiny_checkpoint

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 500000.0}
    folder = build_tiny_checkpoint(tmp_path, "llama", tie=True, rope_scaling=rope, rope_theta=500000.0)
    _check_against_transformers(folder, prompt_len=30)


def test_hf_backend_matches_native(tiny_qwen):
    native = load_native(tiny_qwen, torch.float32)
    wrapped = load_model(str(tiny_qwen), backend="hf")
    assert isinstance(wrapped, HFModel)
    ids = torch.arange(10) % native.config.vocab_size
    a = native.forward(ids, native.new_cache(16), 0)
    cache = wrapped.new_cache(16)
    b = torch.cat([wrapped.forward(ids[:6], cache, 0), wrapped.forward(ids[6:], cache, 6)])
    assert (a - b).abs().max() <= 1e-4
    # after a rollback the HF cache crops, so a rewrite of the same positions gives the same logits
    cache.rollback(6)
    assert (wrapped.forward(ids[6:], cache, 6) - b[6:]).abs().max() <= 1e-5


def test_rollback_then_regenerate_gives_identical_logits(tiny_llama):
    model = load_native(tiny_llama, torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache(32)
    model.forward(ids[:8], cache, 0)
    first = model.forward(ids[8:], cache, 8)  # 4 more tokens
    junk = torch.randint(0, model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(4))
    model.forward(junk, cache, 8)  # a rejected draft overwrites positions 8..13
    cache.rollback(8)
    again = model.forward(ids[8:], cache, 8)
    assert torch.equal(first, again)
    fresh = model.forward(ids, model.new_cache(32), 0)[8:]
    assert (fresh - again).abs().max() <= 1e-5


def test_rollback_is_constant_time_and_checks_bounds(tiny_llama):
    """Rollback touches no KV memory (nothing copied, cleared or reallocated: O(1)), and a rolled-back
    cache then computes what a fresh one does (generate, trim, regenerate: identical logits)."""
    model = load_native(tiny_llama, torch.float32)
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    cache = model.new_cache(16)
    model.forward(tokens, cache, 0)
    keys, values, pointer = cache.keys.clone(), cache.values.clone(), cache.keys.data_ptr()
    cache.rollback(4)
    assert cache.length == 4 and cache.keys.data_ptr() == pointer
    assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)  # stale positions left as they were
    replaced = model.forward(torch.tensor([7, 8]), cache, 4)  # overwrites positions 4, 5
    fresh = model.forward(torch.cat([tokens[:4], torch.tensor([7, 8])]), model.new_cache(16), 0)[4:]
    assert torch.allclose(replaced, fresh, atol=1e-5, rtol=0)  # fp32: BLAS rounding differs with the row count
    with pytest.raises(ValueError):
        cache.rollback(17)


def test_cache_capacity_error_is_clear(tiny_llama):
    from verispec.errors import VerispecError

    model = load_native(tiny_llama, torch.float32)
    with pytest.raises(VerispecError, match="KV cache holds 4 positions"):
        model.forward(torch.arange(5), model.new_cache(4), 0)
    with pytest.raises(VerispecError, match="context is 256"):
        model.new_cache(1000)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
def test_bfloat16_runs_close_to_float32(fixture, request):
    folder = request.getfixturevalue(fixture)
    model32 = load_native(folder, torch.float32)
    model16 = load_native(folder, torch.bfloat16)
    ids = torch.arange(40) % model32.config.vocab_size  # a prefill above the kernel's row limit, then steps
    a = model32.forward(ids, model32.new_cache(40), 0)
    cache = model16.new_cache(40)
    b = torch.cat([model16.forward(ids[:30], cache, 0), model16.forward(ids[30:35], cache, 30),
                   model16.forward(ids[35:], cache, 35)])
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.05 * a.abs().max()
