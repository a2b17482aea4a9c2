"""A static KV cache: preallocated, written by position, rolled back in O(1)."""

from __future__ import annotations

import torch

from verispec.errors import VerispecError


class KVCache:
    """Keys and values of every layer for one sequence, in one preallocated buffer.

    Writes go to explicit positions (gpt-fast's ``KVCache.update``), so rolling back to an
    earlier length copies nothing: ``rollback(n)`` only moves ``length``, and the next write
    at position n overwrites what a rejected draft left behind.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype) -> None:
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)  # [layers, kv_heads, capacity, head_dim]
        self.values = torch.zeros(shape, dtype=dtype)  # [layers, kv_heads, capacity, head_dim]
        self.capacity = capacity
        self.length = 0  # positions [0, length) hold the committed sequence

    def check_room(self, end: int) -> None:
        if end > self.capacity:
            raise VerispecError(
                f"KV cache holds {self.capacity} positions but {end} are needed; "
                "raise the cache size or lower max_new_tokens"
            )

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values for positions [start, start+T) and return all of [0, start+T)."""
        end = start + keys.shape[1]  # keys: [kv_heads, T, head_dim]
        self.keys[layer, :, start:end] = keys
        self.values[layer, :, start:end] = values
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on. O(1): nothing is copied or cleared."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"cannot roll back to {length} (capacity {self.capacity})")
        self.length = length
