"""Low-rank drafts: the target's weight matrices replaced by truncated-SVD factors for the draft pass."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from verispec.drafters.self_speculative import SelfDrafter
from verispec.errors import VerispecError
from verispec.kernels import Linear
from verispec.paths import cache_dir

log = logging.getLogger(__name__)

GROUPS = {"attention": ("qkv", "o"), "mlp": ("gate_up", "down")}
MATRICES = ("qkv", "o", "gate_up", "down")


class LowRankLinear(nn.Module):
    """x -> (x B^T) A^T: a [out, in] matrix as [out, r] x [r, in] factors (two cheap products)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.inner = Linear(b.shape[1], b.shape[0], bias=False)  # B: [r, in]
        self.outer = Linear(a.shape[1], a.shape[0], bias=bias is not None)  # A: [out, r]
        self.inner.weight = nn.Parameter(b, requires_grad=False)
        self.outer.weight = nn.Parameter(a, requires_grad=False)
        if bias is not None:
            self.outer.bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x))


class _LayerProjections:
    """A layer's four products, each either the original matrix or its low-rank factors."""

    def __init__(self, **products: nn.Module) -> None:
        self.__dict__.update(products)


def choose_rank(singular_values: torch.Tensor, rank: int | None, energy: float | None) -> int:
    """The given rank, or the smallest keeping ``energy`` of sum(s^2); rounded up to a multiple of 8."""
    if rank is None:
        share = (singular_values.double() ** 2).cumsum(0) / (singular_values.double() ** 2).sum()
        rank = int((share < energy).sum()) + 1
    return min(-(-rank // 8) * 8, singular_values.numel())


def factorize(weight: torch.Tensor, rank: int | None, energy: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD of weight [out, in] -> A [out, r] (U S), B [r, in] (V^T), in fp32."""
    u, s, vh = torch.linalg.svd(weight.float(), full_matrices=False)
    r = choose_rank(s, rank, energy)
    return (u[:, :r] * s[:r]).contiguous(), vh[:r].contiguous()


class LowRank(SelfDrafter):
    """Draft with truncated-SVD factors of the chosen matrices; verification uses the original weights.

    ``rank`` fixes r for every matrix; ``energy`` (0 < energy < 1) picks, per matrix, the smallest r
    keeping that fraction of spectral energy. ``targets`` names the matrices: "attention" (fused qkv
    and output projections), "mlp" (fused gate/up and down), or single names (qkv, o, gate_up, down);
    ``lm_head=True`` factors the LM head too. Factors are computed once and cached on disk next to
    the converted weights (or in the verispec cache).
    """

    method = "low-rank"

    def __init__(self, rank: int | None = None, energy: float | None = None, k: int = 4,
                 targets: Sequence[str] = ("attention", "mlp"), lm_head: bool = False) -> None:
        super().__init__(k)
        if (rank is None) == (energy is None):
            raise VerispecError("LowRank takes exactly one of rank= or energy=")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise VerispecError(f"rank must be an integer >= 1, got {rank!r}")
        if energy is not None and not 0 < energy < 1:
            raise VerispecError(f"energy must be in (0, 1), got {energy!r}")
        names: list[str] = []
        for t in targets:
            if t not in GROUPS and t not in MATRICES:
                raise VerispecError(f"unknown low-rank target '{t}'; use attention, mlp, {', '.join(MATRICES)}")
            names.extend(GROUPS.get(t, (t,)))
        self.rank, self.energy, self.lm_head = rank, energy, lm_head
        self.matrices = tuple(m for m in MATRICES if m in names)
        self.factor_bytes = 0
        self.mean_rank = 0.0

    def settings(self) -> dict[str, Any]:
        return {"method": self.method, "k": self.k, "rank": self.rank, "energy": self.energy,
                "matrices": list(self.matrices) + (["lm_head"] if self.lm_head else []),
                "mean_rank": round(self.mean_rank, 1), "factor_megabytes": round(self.factor_bytes / 1e6, 2)}

    def check(self, model: Any) -> None:
        if getattr(self, "_model", None) is model:
            return
        factors = self._load_or_compute(model)
        dtype = model.dtype
        projections, ranks, nbytes = [], [], 0
        for i, layer in enumerate(model.layers):
            products: dict[str, nn.Module] = {}
            for name in MATRICES:
                original = getattr(layer, name)
                if name not in self.matrices:
                    products[name] = original
                    continue
                a, b = factors[f"{i}.{name}.a"].to(dtype), factors[f"{i}.{name}.b"].to(dtype)
                products[name] = LowRankLinear(a, b, original.bias)
                ranks.append(b.shape[0])
                nbytes += (a.numel() + b.numel()) * a.element_size()
            projections.append(_LayerProjections(**products))
        self.head = None
        if self.lm_head:
            a, b = factors["head.a"].to(dtype), factors["head.b"].to(dtype)
            self.head = LowRankLinear(a, b, None)
            ranks.append(b.shape[0])
            nbytes += (a.numel() + b.numel()) * a.element_size()
        self.projections, self.factor_bytes = projections, nbytes
        self.mean_rank = sum(ranks) / len(ranks) if ranks else 0.0
        self._model = model
        log.info("low-rank draft: mean rank %.0f, factors %.1f MB", self.mean_rank, nbytes / 1e6)

    def _cache_path(self, model: Any) -> Path:
        key = json.dumps({"model": str(getattr(model, "folder", model.name)), "rank": self.rank,
                          "energy": self.energy, "matrices": self.matrices, "head": self.lm_head,
                          "shape": [model.config.num_layers, model.config.hidden_size]})
        name = f"lowrank-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"
        folder = getattr(model, "folder", None)
        if folder is not None and Path(folder).is_relative_to(cache_dir()):
            return Path(folder) / "lowrank" / name  # beside the converted weights
        return cache_dir() / "lowrank" / name

    def _load_or_compute(self, model: Any) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file, save_file

        path = self._cache_path(model) if getattr(model, "folder", None) else None
        if path is not None and path.exists():
            return load_file(str(path))
        log.info("computing truncated SVDs for the low-rank draft (once%s)", f"; cached in {path}" if path else "")
        factors: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(model.layers):
            for name in self.matrices:
                a, b = factorize(getattr(layer, name).weight, self.rank, self.energy)
                factors[f"{i}.{name}.a"], factors[f"{i}.{name}.b"] = a, b
        if self.lm_head:
            factors["head.a"], factors["head.b"] = factorize(model.lm_head.weight, self.rank, self.energy)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            save_file(factors, str(tmp))
            tmp.replace(path)
        return factors

    def draft_logits(self, model: Any, cache: Any, token: int, position: int) -> torch.Tensor:
        hidden = model.run_layers(model.embed_tokens(torch.tensor([token])), cache, position, model.all_layers,
                                  projections=self.projections)
        return model.logits(hidden, head=self.head)[-1]
