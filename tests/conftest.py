"""Tiny random checkpoints built in the tests, and the offline real model when it can be had."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def missing_setup(reason: str) -> None:
    """Skip a test whose setup is missing (a model, shared data, a compiler) — or, under
    ``VERISPEC_STRICT_SKIPS=1`` (CI), fail it: a green CI must not hide a missing install step."""
    if os.environ.get("VERISPEC_STRICT_SKIPS") == "1":
        pytest.fail(f"missing setup (VERISPEC_STRICT_SKIPS=1 makes this a failure): {reason}")
    pytest.skip(reason)


def build_tiny_checkpoint(folder: Path, arch: str = "llama", vocab: int = 64, layers: int = 2, seed: int = 0,
                          tie: bool = False, **extra) -> Path:
    """A random transformers checkpoint (no tokenizer) saved as safetensors in ``folder``."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tie, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    common.update(extra)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**{"sliding_window": 128, **common}))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # transformers zero-initialises biases; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    with torch.no_grad():  # default init gives near-uniform logits; sharpen them so tests see structure
        model.lm_head.weight.mul_(8.0) if not tie else model.model.embed_tokens.weight.mul_(4.0)
    model.save_pretrained(str(folder))
    return folder


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def save_tiny_tokenizer(folder: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer of exactly ``vocab`` entries, trained on a few lines, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["def add(a, b):\n    return a + b\n", "Translate German to English: guten Tag", "the cat sat on the mat"] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))


@pytest.fixture(scope="session")
def tiny_chat_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny target and draft (same tokenizer, with a chat template) for end-to-end benchmarks."""
    folders = []
    for name, layers, seed in (("target", 2, 11), ("draft", 1, 12)):
        folder = build_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny_{name}"), "llama", vocab=300, layers=layers,
                                       seed=seed)
        save_tiny_tokenizer(folder, 300)
        folders.append(folder)
    return folders[0], folders[1]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen"), "qwen2", seed=2)


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The converted SmolLM2-135M folder, or a skip saying why it is not available."""
    from verispec.errors import VerispecError
    from verispec.models.loading import resolve_source

    if os.environ.get("VERISPEC_SKIP_REAL_MODELS"):
        pytest.skip("VERISPEC_SKIP_REAL_MODELS is set")
    try:
        return resolve_source("smollm2-135m")
    except VerispecError as exc:
        missing_setup(f"SmolLM2-135M could not be fetched here: {exc}")


def requires_shared() -> Path:
    if not SHARED.is_dir():
        missing_setup(f"../shared is absent ({SHARED}); evaluation data unavailable")
    return SHARED
