"""Low-rank drafts: the target's weight matrices replaced by truncated-SVD factors for the draft pass."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from verispec.drafters.base import DEFAULT_K, DraftContext
from verispec.drafters.registry import DrafterSpec, Param
from verispec.drafters.self_speculative import LayerProjections, SwappedMatrices
from verispec.errors import VerispecError
from verispec.models.protocol import LayeredModel
from verispec.validation import number, positive_int
from verispec.kernels import Linear, dense_weight
from verispec.paths import cache_dir

log = logging.getLogger(__name__)

GROUPS = {"attention": ("qkv", "o"), "mlp": ("gate_up", "down")}
MATRICES = ("qkv", "o", "gate_up", "down")


_FACTORS: dict[Path, dict[str, torch.Tensor]] = {}  # factors this process has read or computed, by file


class LowRankLinear(nn.Module):
    """x -> (x B^T) A^T: a [out, in] matrix as [out, r] x [r, in] factors (two cheap products)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        # on the meta device: no memory and no random initialisation for weights replaced at once (the
        # initialisation took 0.13 s of every SmolLM2 run's start, 8% of a 128-token run)
        self.inner = Linear(b.shape[1], b.shape[0], bias=False, device="meta")  # B: [r, in]
        self.outer = Linear(a.shape[1], a.shape[0], bias=bias is not None, device="meta")  # A: [out, r]
        self.inner.weight = nn.Parameter(b, requires_grad=False)
        self.outer.weight = nn.Parameter(a, requires_grad=False)
        if bias is not None:
            self.outer.bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x))


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


class LowRank(SwappedMatrices):
    """Draft with truncated-SVD factors of the chosen matrices; verification uses the original weights.

    ``rank`` fixes r for every matrix; ``energy`` (0 < energy < 1) picks, per matrix, the smallest r
    keeping that fraction of spectral energy. ``targets`` names the matrices: "attention" (fused qkv
    and output projections), "mlp" (fused gate/up and down), or single names (qkv, o, gate_up, down);
    ``lm_head=True`` factors the LM head too. Factors are computed once and cached on disk next to
    the converted weights (or in the verispec cache).
    """

    method = "low-rank"

    def __init__(self, rank: int | None = None, energy: float | None = None, k: int | str | None = None,
                 targets: Sequence[str] = ("attention", "mlp"), lm_head: bool = False) -> None:
        super().__init__(DEFAULT_K if k is None else k)
        if (rank is None) == (energy is None):
            raise VerispecError("LowRank takes exactly one of rank= or energy=")
        if rank is not None:
            positive_int(rank, "rank")
        if energy is not None:
            number(energy, "energy", 0, 1, low_open=True, high_open=True)
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

    def start(self, context: DraftContext) -> None:
        super().start(context)
        plan = self.plan_for(context.target)
        self.mean_rank, self.factor_bytes = plan.mean_rank, plan.factor_bytes  # of the target now running

    def check(self, model: LayeredModel) -> "_LowRankPlan":
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
            projections.append(LayerProjections(**products))
        head = None
        if self.lm_head:
            a, b = factors["head.a"].to(dtype), factors["head.b"].to(dtype)
            head = LowRankLinear(a, b, None)
            ranks.append(b.shape[0])
            nbytes += (a.numel() + b.numel()) * a.element_size()
        plan = _LowRankPlan(projections, head, sum(ranks) / len(ranks) if ranks else 0.0, nbytes)
        log.info("low-rank draft: mean rank %.0f, factors %.1f MB", plan.mean_rank, nbytes / 1e6)
        return plan

    def _cache_path(self, model: Any) -> Path:
        key = json.dumps({"model": str(model.folder or model.name), "rank": self.rank,
                          "quantization": getattr(model, "quantization", None),
                          "energy": self.energy, "matrices": self.matrices, "head": self.lm_head,
                          "shape": [model.config.num_layers, model.config.hidden_size]})
        name = f"lowrank-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"
        folder = model.folder
        if folder is not None and Path(folder).is_relative_to(cache_dir()):
            return Path(folder) / "lowrank" / name  # beside the converted weights
        return cache_dir() / "lowrank" / name

    def _load_or_compute(self, model: Any) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file, save_file

        path = self._cache_path(model) if model.folder else None
        if path is not None and path in _FACTORS:  # this process read them already (a drafter per run)
            return _FACTORS[path]
        if path is not None and path.exists():
            _FACTORS[path] = load_file(str(path))
            return _FACTORS[path]
        log.info("computing truncated SVDs for the low-rank draft (once%s)", f"; cached in {path}" if path else "")
        factors: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(model.layers):
            for name in self.matrices:
                a, b = factorize(dense_weight(getattr(layer, name)), self.rank, self.energy)
                factors[f"{i}.{name}.a"], factors[f"{i}.{name}.b"] = a, b
        if self.lm_head:
            factors["head.a"], factors["head.b"] = factorize(dense_weight(model.lm_head), self.rank, self.energy)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            save_file(factors, str(tmp))
            tmp.replace(path)
            _FACTORS[path] = factors
        return factors


@dataclasses.dataclass(frozen=True)
class _LowRankPlan:
    projections: list[LayerProjections]  # per layer: original or factored products
    head: LowRankLinear | None
    mean_rank: float
    factor_bytes: int


def _describe(p: dict[str, Any], target: str) -> str:
    size = f"rank {p['rank']}" if "rank" in p else f"{p['energy']:.0%} energy"
    return f"{target} with {size} factors of {'+'.join(p.get('targets', ('attention', 'mlp')))}"


SPEC = DrafterSpec(
    name="low-rank", summary="the target with chosen matrices replaced by truncated-SVD factors",
    params=(
        Param("rank", "int", "Self-speculative: low-rank draft of this rank.", flag="--low-rank-rank", selects=True),
        Param("energy", "float", "Self-speculative: low-rank draft keeping this fraction of spectral energy per matrix.",
              flag="--low-rank-energy", selects=True, bounds=(0.0, 1.0)),
        Param("targets", "strs", "Matrices the low-rank draft factors: attention, mlp, qkv, o, gate_up, down.",
              default="attention,mlp", flag="--low-rank-targets"),
    ),
    build=lambda p, k, load: LowRank(**p, k=k),
    describe=_describe,
    per_request=False,
)
