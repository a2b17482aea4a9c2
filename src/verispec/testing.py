"""Tiny models for exactness tests and the lossiness report (no transformers, no files).

Used by the test suite and by ``benchmarks/lossiness.py``; small enough to enumerate output laws.
"""

from __future__ import annotations

import copy

import torch

from verispec.models.config import ModelConfig
from verispec.models.transformer import Transformer


def tiny_model(vocab: int = 6, seed: int = 0, layers: int = 2, hidden: int = 16, sharpness: float = 3.0,
               eos: tuple[int, ...] = (), context: int = 64) -> Transformer:
    """A random fp32 transformer whose next-token distributions depend on the whole context."""
    config = ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_layers=layers, num_heads=2, num_kv_heads=1, head_dim=hidden // 2,
                         max_position_embeddings=context, eos_token_ids=eos)
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            param.normal_(0, 1.0 / hidden ** 0.5)
        model.lm_head.weight.mul_(sharpness)
        model.embed.weight.mul_(hidden ** 0.5)
    model.name = f"tiny-{seed}"
    return model.eval().requires_grad_(False)


def perturbed(model: Transformer, seed: int, scale: float) -> Transformer:
    """A copy of ``model`` with every weight nudged by Gaussian noise (``scale`` x its std): a draft
    that resembles its target the way real drafts do."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.std())
    draft.name = f"{model.name}-perturbed-{seed}"
    return draft


class TokenCache:
    """The table model's 'KV cache': token ids written by position, rolled back by moving ``length``."""

    def __init__(self, capacity: int) -> None:
        self.tokens = [-1] * capacity
        self.capacity = capacity
        self.length = 0

    def check_room(self, end: int) -> None:
        assert end <= self.capacity, "table model cache overflow"

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.capacity
        self.length = length


class TableModel:
    """A tiny language model whose next-token logits are a fixed random function of the whole context.

    It implements the decoder's model protocol (``config``, ``new_cache``, ``forward``) at a cost of
    microseconds per call, so the whole-sequence distribution tests can draw tens of thousands of
    sequences. Its cache really stores the context by position: a decoder that rolls back wrongly
    feeds it the wrong context and changes the output distribution, which the tests then catch.
    """

    def __init__(self, vocab: int = 5, seed: int = 0, sharpness: float = 1.5) -> None:
        self.config = ModelConfig(architecture="table", vocab_size=vocab, hidden_size=0, intermediate_size=0,
                                  num_layers=0, num_heads=1, num_kv_heads=1, head_dim=0,
                                  max_position_embeddings=64)
        self.seed, self.sharpness = seed, sharpness
        self.tokenizer = None
        self.name = f"table-{seed}"
        self.folder = None
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    def new_cache(self, capacity: int) -> TokenCache:
        return TokenCache(capacity)

    def next_logits(self, context: tuple[int, ...]) -> torch.Tensor:
        logits = self._memo.get(context)
        if logits is None:
            generator = torch.Generator().manual_seed(hash((self.seed,) + context) & 0x7FFFFFFF)
            logits = torch.randn(self.config.vocab_size, generator=generator) * self.sharpness
            self._memo[context] = logits
        return logits

    def forward(self, input_ids: torch.Tensor, cache: TokenCache, start: int, last_only: bool = False) -> torch.Tensor:
        ids = input_ids.tolist()
        cache.check_room(start + len(ids))
        cache.tokens[start:start + len(ids)] = ids
        cache.length = start + len(ids)
        first = len(ids) - 1 if last_only else 0
        return torch.stack([self.next_logits(tuple(cache.tokens[: start + i + 1])) for i in range(first, len(ids))])
