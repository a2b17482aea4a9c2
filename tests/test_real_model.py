"""SmolLM2-135M (fetched from PyPI wheels, skipped with a reason when that is impossible)."""

from __future__ import annotations

import torch

import verispec
from verispec.models.loading import load_native


def test_native_matches_transformers_gguf_loader(smollm2_folder):
    """Our GGUF conversion + runtime against transformers' own GGUF loader, fp32."""
    from transformers import AutoModelForCausalLM

    from verispec.models.catalogue import lookup

    gguf = lookup("smollm2-135m").path
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    native = load_native(smollm2_folder, torch.float32)
    ids = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids.view(1, -1)).logits[0]
    cache = native.new_cache(24)
    got = torch.cat([native.forward(ids[:16], cache, 0), native.forward(ids[16:21], cache, 16),
                     native.forward(ids[21:], cache, 21)])
    assert (got - expected).abs().max() <= 1e-4


def test_cli_generate_real_model(smollm2_folder):
    from click.testing import CliRunner

    from verispec.cli import main

    result = CliRunner().invoke(main, ["generate", "The capital of France is", "-n", "8", "--dtype", "float32",
                                       "--json"])
    assert result.exit_code == 0, result.output
    record = result.output[result.output.index("{"):]
    import json

    data = json.loads(record)
    assert data["stats"]["new_tokens"] == len(data["token_ids"]) <= 8 and "Paris" in data["text"]


def test_chat_template_and_stop_string(smollm2_folder):
    model = verispec.load_model("smollm2-135m")
    result = verispec.generate(model, "Count from 1 to 10, separated by commas.", chat=True, max_new_tokens=40,
                               stop=["5"])
    assert result.finish_reason == "stop" and "5" not in result.text and "4" in result.text
