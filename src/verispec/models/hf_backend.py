"""The ``hf`` backend: any transformers causal LM behind the same small protocol as the native runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from verispec.errors import VerispecError
from verispec.models.config import ModelConfig


class HFCache:
    """A transformers DynamicCache with the native cache's interface. Rollback crops (not O(1))."""

    def __init__(self, capacity: int) -> None:
        from transformers import DynamicCache

        self.inner = DynamicCache()
        self.capacity = capacity
        self.length = 0

    def check_room(self, end: int) -> None:
        if end > self.capacity:
            raise VerispecError(f"KV cache holds {self.capacity} positions but {end} are needed")

    def rollback(self, length: int) -> None:
        self.length = length

    def sync(self, start: int) -> None:
        """Drop whatever lies at or after ``start`` before new tokens are written there."""
        excess = self.inner.get_seq_length() - start
        if excess > 0:
            self.inner.crop(-excess)  # transformers 5 takes the number of tokens to drop, negated


class HFModel:
    def __init__(self, network: Any, config: ModelConfig) -> None:
        import inspect

        self.network, self.config = network, config
        # transformers 5 renamed `past_key_values` to `cache`; decide once, not in the hot path.
        params = inspect.signature(network.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # Declared by the model protocol; ``load_model`` fills them in.
        self.tokenizer: Any | None = None
        self.name: str = ""
        self.folder: Path | None = None

    @classmethod
    def from_folder(cls, folder: Path, dtype: torch.dtype) -> "HFModel":
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = AutoConfig.from_pretrained(str(folder))
        network = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
        return cls(network, _describe(hf_config))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.network.parameters()).dtype

    def new_cache(self, capacity: int) -> HFCache:
        if capacity > self.config.max_position_embeddings:
            raise VerispecError(f"{capacity} positions requested but the model's context is "
                                f"{self.config.max_position_embeddings} tokens")
        return HFCache(capacity)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: HFCache, start: int, last_only: bool = False) -> torch.Tensor:
        T = input_ids.numel()
        cache.check_room(start + T)
        cache.sync(start)
        positions = torch.arange(start, start + T).view(1, -1)
        out = self.network(input_ids=input_ids.view(1, -1), position_ids=positions, use_cache=True,
                           **{self._cache_arg: cache.inner})
        cache.length = start + T
        logits = out.logits[0].float()  # [T, vocab]
        return logits[-1:] if last_only else logits


def _describe(hf: Any) -> ModelConfig:
    """The few numbers the decoder needs, for any architecture."""
    eos = getattr(hf, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    heads = getattr(text, "num_attention_heads", 1)
    hidden = getattr(text, "hidden_size", 0)
    return ModelConfig(
        architecture=getattr(hf, "model_type", "unknown"), vocab_size=text.vocab_size, hidden_size=hidden,
        intermediate_size=getattr(text, "intermediate_size", 0), num_layers=getattr(text, "num_hidden_layers", 0),
        num_heads=heads, num_kv_heads=getattr(text, "num_key_value_heads", heads) or heads,
        head_dim=getattr(text, "head_dim", None) or (hidden // heads if heads else 0),
        max_position_embeddings=getattr(text, "max_position_embeddings", 2048), eos_token_ids=eos_ids,
        bos_token_id=getattr(hf, "bos_token_id", None),
    )
