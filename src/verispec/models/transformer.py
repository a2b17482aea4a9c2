"""A lean decoder-only transformer (Llama, Qwen2, Mistral) written for batch-1 CPU decoding.

Weights are stored in the model's dtype (bf16 for speed, fp32 for exactness); activations, the
residual stream, norms, rotary tables and the KV cache are always fp32. With bf16 weights that
costs no extra memory traffic, avoids a dtype conversion around every small op, and is at least
as accurate as transformers' all-bf16 path.

The forward pass is split into ``embed`` -> ``run_layers`` -> ``logits`` so that drafters can
run a subset of layers (layer skipping), stop at an intermediate layer (early exit) or swap
projections for low-rank factors, all without a second copy of the model code.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

import torch
from torch import nn

from verispec import kernels
from verispec.kernels import Linear
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


def _matrices(proj: Any) -> tuple[nn.Module, ...]:
    """A layer's four products in the order ``kernels.layer_stack`` takes them (an ``nn.Module`` keeps
    its submodules in ``_modules``; a draft's ``LayerProjections`` in attributes)."""
    table = proj._modules if isinstance(proj, nn.Module) else proj.__dict__
    return table["qkv"], table["o"], table["gate_up"], table["down"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)  # fp32 in, fp32 weight, one call


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


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, transformers' rotate_half form: x*cos + cat(-x2, x1)*sin.

    ``signed_sin`` is cat(-sin1, sin2), so cat(-x2, x1)*sin == roll(x, half)*signed_sin: one op fewer.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


# A prompt's MLP runs over this many rows at a time: the [rows, 2 * intermediate] activations then stay
# in the caches (700 rows of Qwen 1.5B's gate/up would be a fresh 50 MB buffer per layer, whose page
# faults cost as much as the product: its int8 product took 51 ms in one piece, 27 ms in chunks).
MLP_ROWS = 128


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = config.head_dim ** -0.5
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o = Linear(q_size, config.hidden_size, bias=False)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def attention(self, x: torch.Tensor, cache: KVCache, layer: int, start: int, rope: tuple[torch.Tensor, torch.Tensor],
                  proj: Projections) -> torch.Tensor:
        T = x.shape[1]  # x: [1, T, hidden]
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = proj.qkv(self.attn_norm(x)).view(T, H + 2 * KV, D).transpose(0, 1)  # [H + 2 KV, T, D]
        cos, sin = rope  # [T, D] each; sin's first half negated (see rotate)
        qk = qkv[: H + KV]
        qk = rotate(qk, cos, sin)  # queries and keys rotated together: [H + KV, T, D]
        keys, values = cache.write(layer, start, qk[H:], qkv[H + KV:])  # [KV, start + T, D]
        out = kernels.causal_attention(qk[:H] * self.scale, keys, values, start)  # [T, H * D]
        return proj.o(out.view(1, T, H * D))  # [1, T, hidden]

    def mlp(self, x: torch.Tensor, proj: Projections) -> torch.Tensor:
        T = x.shape[1]
        if T > MLP_ROWS:  # a prompt: in chunks of rows (each row's MLP is its own)
            return torch.cat([self.mlp(x[:, b:b + MLP_ROWS], proj) for b in range(0, T, MLP_ROWS)], dim=1)
        return proj.down(kernels.gate_up_silu(proj.gate_up, self.mlp_norm(x)))  # [1, T, I] -> hidden


class Transformer(nn.Module):
    """Decoder-only transformer. Weights use fused qkv and gate/up projections (fewer ops per layer)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        # Declared by the model protocol; ``load_model`` fills them in.
        self.tokenizer: Any | None = None
        self.name: str = config.name
        self.folder: Path | None = None
        self.quantization: str | None = None  # "int8" once ``models.quantize`` replaced the matrices
        self._rope_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stacks: dict[int, tuple[Any, list[Any], Any]] = {}  # id(projections) -> (them, parts, LayerStack)

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the compiled stacks behind (they hold this model's tensors; a copy
        builds its own on first use)."""
        state = self.__dict__.copy()
        state["_stacks"] = {}
        return state

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (activations are fp32 whatever it is)."""
        return self.embed.weight.dtype

    def to_weight_dtype(self, dtype: torch.dtype) -> "Transformer":
        """Cast matrices to ``dtype``; norm weights and biases stay fp32 like the activations.

        Parameters only: an int8 layer's weights, scales and sums are buffers and keep their types.
        The small fp32 tensors are copied: loaded weights are views of the checkpoint file's memory map,
        and one kept view would keep the whole file mapped (gigabytes of resident pages for an int8 or
        bf16 model that no longer reads them).
        """
        for name, param in self.named_parameters():
            keep_fp32 = "norm" in name or name.endswith("bias")
            param.data = param.data.to(torch.float32 if keep_fp32 else dtype, copy=keep_fp32)
        return self

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
        if c.sliding_window is not None and capacity > c.sliding_window:
            raise VerispecError(
                f"{capacity} positions exceed this model's {c.sliding_window}-token sliding attention window, "
                "which the native runtime does not implement; use backend='hf' or a shorter run"
            )
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, torch.float32)

    def _rope(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._rope_cache.get("table")
        if table is None or table[0].shape[0] < end:
            length = max(end, 4096)
            angles = torch.outer(torch.arange(length, dtype=torch.float32), rope_inverse_frequencies(self.config))
            sin = angles.sin()
            cos = torch.cat((angles.cos(), angles.cos()), dim=-1)  # [length, head_dim]
            signed_sin = torch.cat((-sin, sin), dim=-1)
            table = (cos, signed_sin)
            self._rope_cache["table"] = table
        return table[0][start:end], table[1][start:end]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids.view(1, -1)).float()  # [1, T, hidden]

    def run_layers(self, hidden: torch.Tensor, cache: KVCache, start: int, steps: Iterable[LayerStep],
                   projections: Sequence[Projections] | None = None) -> torch.Tensor:
        """Run ``steps`` over hidden states of positions [start, start+T), writing those layers' KV.

        ``projections[i]`` replaces layer i's matrices (a low-rank draft); None keeps the real ones.
        """
        T = hidden.shape[1]  # hidden: [1, T, hidden]
        cache.check_room(start + T)
        rope = self._rope(start, start + T)
        stack = self._stack(projections)
        if stack is not None:  # the same arithmetic in one compiled call (kernels/layers.cpp)
            steps = list(steps)
            # bf16 products of more rows than the few-row kernel takes, widened as kernels.linear widens
            # them (asked only of bf16 models: an fp32 or int8 model never measures the bf16 paths)
            widen = T > kernels.MAX_ROWS and self.dtype is torch.bfloat16 and kernels.bf16_prompt_path() == "fp32"
            return stack.run(hidden, [s.index for s in steps], [s.attention | s.mlp << 1 for s in steps],
                             cache.keys, cache.values, start, rope[0], rope[1], kernels.int8_path(T), MLP_ROWS,
                             widen)
        for step in steps:
            layer = self.layers[step.index]
            proj = layer if projections is None else projections[step.index]
            if step.attention:
                hidden = hidden + layer.attention(hidden, cache, step.index, start, rope, proj)
            if step.mlp:
                hidden = hidden + layer.mlp(hidden, proj)
        return hidden

    def _stack(self, projections: Sequence[Projections] | None) -> Any:
        """The compiled ``LayerStack`` over these matrices (None: the model's own), built once and rebuilt
        when a module was swapped since (quantization); None when the pass must run in Python: no
        compiled kernels, ``kernels.fused_layers()`` off, or a projection the stack cannot run (low-rank
        factors, int4)."""
        if not kernels.fused_layers():
            return None
        layers = self.layers._modules.values()
        sources = layers if projections is None else projections
        parts = [m for layer, proj in zip(layers, sources) for m in (
            layer._modules["attn_norm"], layer._modules["mlp_norm"], *_matrices(proj))]
        entry = self._stacks.get(id(projections))
        if entry is not None and entry[0] is projections and len(entry[1]) == len(parts) \
                and all(map(operator.is_, entry[1], parts)):
            return entry[2]
        stack = kernels.layer_stack(parts, self.config)
        self._stacks[id(projections)] = (projections, parts, stack)
        return stack

    def logits(self, hidden: torch.Tensor, head: nn.Module | None = None) -> torch.Tensor:
        """Final norm and LM head: [1, T, hidden] -> fp32 logits [T, vocab]."""
        return (head or self.lm_head)(self.norm(hidden))[0].float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: KVCache, start: int, last_only: bool = False) -> torch.Tensor:
        """Full pass over tokens at positions [start, start+T): fp32 logits [T, vocab] ([1, vocab] if last_only)."""
        return self.forward_hidden(self.embed_tokens(input_ids), cache, start, self.all_layers, last_only)

    @torch.inference_mode()
    def forward_hidden(self, hidden: torch.Tensor, cache: KVCache, start: int, steps: Sequence[LayerStep],
                       last_only: bool = False) -> torch.Tensor:
        """``steps`` then the head over hidden states [1, T, hidden] at [start, start+T): fp32 logits
        [T, vocab] ([1, vocab] if last_only); the cache then holds [0, start+T).

        With bf16 weights, more rows than ``kernels.MAX_ROWS`` go through in chunks of that many: a
        verification row's result must not depend on how many rows share its pass (greedy speculative
        output equals plain output), which the compiled few-row kernel guarantees. Each chunk attends
        to the ones before it through the cache. A prompt (more than ``kernels.INVARIANT_ROWS`` rows)
        takes torch's matmul in one pass (bf16, or fp32 on widened weights) where that measured faster
        (``kernels.bf16_prompt_path``).
        int8 matrices need no chunks: integer sums give the same bits whatever the number of rows.
        """
        T = hidden.shape[1]
        bf16_kernel = self.quantization is None and self.dtype is torch.bfloat16 and kernels.available()
        if bf16_kernel and T > kernels.INVARIANT_ROWS and kernels.bf16_prompt_path() != "chunks":
            bf16_kernel = False
        chunk = kernels.MAX_ROWS if bf16_kernel else T
        outputs = []
        for begin in range(0, T, chunk):
            part = self.run_layers(hidden[:, begin:begin + chunk], cache, start + begin, steps)
            if not last_only or begin + chunk >= T:
                outputs.append(self.logits(part[:, -1:] if last_only else part))
        cache.length = start + T
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]
