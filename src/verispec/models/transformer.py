"""A lean decoder-only transformer (Llama, Qwen2, Mistral) written for batch-1 CPU decoding.

The forward pass is split into ``embed`` -> ``run_layers`` -> ``logits`` so that drafters can
run a subset of layers (layer skipping), stop at an intermediate layer (early exit) or swap
projections for low-rank factors, all without a second copy of the model code.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from verispec.models.cache import KVCache
from verispec.models.config import ModelConfig
from verispec.errors import VerispecError


@dataclasses.dataclass(frozen=True)
class LayerStep:
    """Which parts of one decoder layer a pass runs (Draft & Verify skips attention or MLP separately)."""

    index: int
    attention: bool = True
    mlp: bool = True


class Projections(Protocol):
    """The four matrix products of a decoder layer; a low-rank draft provides its own."""

    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module
    down: nn.Module


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, exactly as transformers does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim // 2], with the rope-scaling variants Llama-family configs use."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.float()
    kind = scaling["rope_type"]
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        return torch.where(medium, smoothed, scaled).float()
    raise VerispecError(f"rope scaling '{kind}' is not supported by the native runtime; use backend='hf'")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o = nn.Linear(q_size, config.hidden_size, bias=False)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def attention(self, x: torch.Tensor, cache: KVCache, layer: int, start: int, rope: tuple[torch.Tensor, torch.Tensor],
                  mask: torch.Tensor | None, proj: Projections) -> torch.Tensor:
        T = x.shape[1]  # x: [1, T, hidden]
        qkv = proj.qkv(self.attn_norm(x))  # [1, T, (heads + 2 kv_heads) * head_dim]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(1, T, self.num_heads, self.head_dim).transpose(1, 2)  # [1, heads, T, head_dim]
        k = k.view(1, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [1, kv_heads, T, head_dim]
        v = v.view(1, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope  # [T, head_dim] each, already in x's dtype
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys, values = cache.write(layer, start, k, v)  # [1, kv_heads, start + T, head_dim]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return proj.o(out.transpose(1, 2).reshape(1, T, q_size))  # [1, T, hidden]

    def mlp(self, x: torch.Tensor, proj: Projections) -> torch.Tensor:
        gate, up = proj.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)  # [1, T, intermediate] each
        return proj.down(F.silu(gate) * up)


class Transformer(nn.Module):
    """Decoder-only transformer. Weights use fused qkv and gate/up projections (fewer ops per layer)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self._rope_cache: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def all_layers(self) -> list[LayerStep]:
        return [LayerStep(i) for i in range(self.config.num_layers)]

    def new_cache(self, capacity: int) -> KVCache:
        c = self.config
        if capacity > c.max_position_embeddings:
            raise VerispecError(
                f"{capacity} positions requested but the model's context is {c.max_position_embeddings} tokens; "
                "shorten the prompt or lower max_new_tokens"
            )
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, self.dtype)

    def _rope(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._rope_cache.get(self.dtype)
        if table is None or table[0].shape[0] < end:
            length = max(end, 4096)
            angles = torch.outer(torch.arange(length, dtype=torch.float32), rope_inverse_frequencies(self.config))
            angles = torch.cat((angles, angles), dim=-1)  # [length, head_dim]
            table = (angles.cos().to(self.dtype), angles.sin().to(self.dtype))
            self._rope_cache[self.dtype] = table
        return table[0][start:end], table[1][start:end]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids.view(1, -1))  # [1, T, hidden]

    def run_layers(self, hidden: torch.Tensor, cache: KVCache, start: int, steps: Iterable[LayerStep],
                   projections: Sequence[Projections] | None = None) -> torch.Tensor:
        """Run ``steps`` over hidden states of positions [start, start+T), writing those layers' KV.

        ``projections[i]`` replaces layer i's matrices (a low-rank draft); None keeps the real ones.
        """
        T = hidden.shape[1]  # hidden: [1, T, hidden]
        cache.check_room(start + T)
        rope = self._rope(start, start + T)
        mask = None
        if T > 1:  # causal within the new tokens, everything before `start` visible
            mask = torch.ones(T, start + T, dtype=torch.bool).tril(diagonal=start)  # [T, start + T]
        for step in steps:
            layer = self.layers[step.index]
            proj = layer if projections is None else projections[step.index]
            if step.attention:
                hidden = hidden + layer.attention(hidden, cache, step.index, start, rope, mask, proj)
            if step.mlp:
                hidden = hidden + layer.mlp(hidden, proj)
        return hidden

    def logits(self, hidden: torch.Tensor, head: nn.Module | None = None) -> torch.Tensor:
        """Final norm and LM head: [1, T, hidden] -> fp32 logits [T, vocab]."""
        return (head or self.lm_head)(self.norm(hidden))[0].float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """Full pass over tokens at positions [start, start+T): fp32 logits [T, vocab]."""
        hidden = self.run_layers(self.embed_tokens(input_ids), cache, start, self.all_layers)
        cache.length = start + input_ids.numel()
        return self.logits(hidden)
