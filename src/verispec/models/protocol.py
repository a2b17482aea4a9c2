"""What the decoding loop and the drafters need from a model, declared (mlx-lm checks capabilities
before it speculates; so do we).

``DecoderModel`` is all the loop needs: a config, a cache factory and a forward pass over new
tokens. ``LayeredModel`` adds what self-speculative drafters need to run part of the target: the
forward pass split into embedding, a chosen sequence of layer steps, and the head. The native
runtime (``Transformer``) is both; the ``hf`` backend is only a ``DecoderModel``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import torch

from verispec.models.config import ModelConfig


@runtime_checkable
class KVCacheLike(Protocol):
    capacity: int
    length: int  # positions [0, length) hold the committed sequence

    def check_room(self, end: int) -> None:
        """Raise ``VerispecError`` when positions up to ``end`` do not fit."""

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on."""


@runtime_checkable
class DecoderModel(Protocol):
    config: ModelConfig
    tokenizer: Any | None  # a transformers tokenizer, or None (then only input_ids work)
    name: str  # what the user called it (catalogue name, path, hub id)
    folder: Path | None  # where derived data (low-rank factors) may be cached; None for in-memory models

    def new_cache(self, capacity: int) -> KVCacheLike:
        """An empty cache for ``capacity`` positions (``VerispecError`` past the context)."""

    def forward(self, input_ids: torch.Tensor, cache: Any, start: int, last_only: bool = False) -> torch.Tensor:
        """Logits [T, vocab] (fp32) of ``input_ids`` [T] at positions [start, start+T); the cache then
        holds positions [0, start+T)."""


@runtime_checkable
class LayeredModel(DecoderModel, Protocol):
    """A model whose forward pass can be run in parts (self-speculative drafting)."""

    layers: Sequence[Any]

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def all_layers(self) -> list[Any]: ...

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [1, T, hidden] fp32."""

    def run_layers(self, hidden: torch.Tensor, cache: Any, start: int, steps: Iterable[Any],
                   projections: Sequence[Any] | None = None) -> torch.Tensor:
        """Run ``steps`` over hidden [1, T, hidden] at [start, start+T), writing those layers' KV."""

    def logits(self, hidden: torch.Tensor, head: Any = None) -> torch.Tensor:
        """Final norm and head: [1, T, hidden] -> [T, vocab] fp32."""

    def forward_hidden(self, hidden: torch.Tensor, cache: Any, start: int, steps: Sequence[Any]) -> torch.Tensor:
        """A pass that starts from hidden states: ``steps``, then the head; the cache then holds
        [0, start+T), as after ``forward``."""
