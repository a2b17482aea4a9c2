"""Quantized drafts: the target's own weights in int8 or int4 for the draft pass.

One checkpoint serves both passes: the draft runs every layer of the target with its matrices and LM
head quantized (int8: per-channel weights with per-row int8 activations, the runtime of
``quantize="int8"``; int4: asymmetric weights with a scale and low per group of 32 inputs and int8
activations, through verispec's packed int4 kernel, which reads 0.625 bytes a weight; without the
compiled kernels, torch's packed int4 kernel with bf16 activations). The target verifies with its own
weights, so the output law stays the target's. The quantized copies cost extra memory, reported in the
run's settings.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from verispec.drafters.base import DEFAULT_K
from verispec.drafters.registry import DrafterSpec, Param
from verispec.drafters.self_speculative import LayerProjections, SwappedMatrices
from verispec.errors import VerispecError
from verispec.kernels import Int4Linear, PackedInt4Linear, available, dense_weight
from verispec.models.protocol import LayeredModel
from verispec.models.quantize import MATRICES, int8_bytes, quantized_linears

log = logging.getLogger(__name__)

BITS = (8, 4)


@dataclasses.dataclass(frozen=True)
class _QuantizedPlan:
    projections: list[LayerProjections]
    head: torch.nn.Module
    extra_bytes: int


def _int4_linears(model: Any) -> dict[str, torch.nn.Module]:
    """int4 copies of the matrices: verispec's packed int4 kernel where it is compiled (groups of 32,
    int8 activations), else torch's packed int4 kernel; a matrix whose shape neither packing takes
    stays int8 (logged)."""
    int8 = None
    out: dict[str, torch.nn.Module] = {}
    names = [f"layers.{i}.{m}" for i in range(model.config.num_layers) for m in MATRICES] + ["lm_head"]
    form = PackedInt4Linear if available() else Int4Linear
    for name in names:
        module = model.get_submodule(name)
        q = form.from_float(dense_weight(module), module.bias)
        if q is None:
            int8 = int8 if int8 is not None else quantized_linears(model, "int8")
            log.info("%s: its shape %s does not fit the int4 packing; it drafts in int8", name,
                     tuple(module.weight.shape))
            q = int8[name]
        out[name] = q
    return out


class QuantizedDraft(SwappedMatrices):
    """Draft with the target's own matrices quantized to ``bits`` (8 or 4); verify with the originals."""

    method = "quantized"

    def __init__(self, bits: int = 8, k: int | str | None = None) -> None:
        super().__init__(DEFAULT_K if k is None else k)
        if isinstance(bits, bool) or bits not in BITS:
            raise VerispecError(f"QuantizedDraft bits must be 8 or 4, got {bits!r}")
        self.bits = int(bits)
        self.extra_bytes = 0

    def settings(self) -> dict[str, Any]:
        return {"method": self.method, "k": self.k, "bits": self.bits,
                "extra_megabytes": round(self.extra_bytes / 1e6, 2)}

    def start(self, context: Any) -> None:
        super().start(context)
        self.extra_bytes = self.plan_for(context.target).extra_bytes

    def check(self, model: LayeredModel) -> _QuantizedPlan:
        if getattr(model, "quantization", None) is not None:
            raise VerispecError(f"the target is already quantized ({model.quantization}); QuantizedDraft drafts "
                                "with quantized copies of a float target's weights")
        linears = quantized_linears(model, "int8") if self.bits == 8 else _int4_linears(model)
        projections = [LayerProjections(**{m: linears[f"layers.{i}.{m}"] for m in MATRICES})
                       for i in range(model.config.num_layers)]
        extra = int8_bytes(linears) if self.bits == 8 else sum(
            b.numel() * b.element_size() for m in linears.values() for b in m.buffers())
        log.info("quantized draft: int%d copies of the target's matrices, %.1f MB", self.bits, extra / 1e6)
        return _QuantizedPlan(projections, linears["lm_head"], extra)


SPEC = DrafterSpec(
    name="quantized", summary="the target's own matrices and head in int8 or int4 for the draft pass",
    params=(Param("bits", "int", "Self-speculative: draft with the target's weights quantized to 8 or 4 bits.",
                  required=True, flag="--quantized-draft", selects=True, minimum=4),),
    build=lambda p, k, load: QuantizedDraft(p["bits"], k=k),
    describe=lambda p, target: f"{target} drafting with its own int{p['bits']} weights",
    per_request=False,
)
