"""An optional compiled kernel for bf16-weight matrix products over a few rows.

On CPUs without native bf16 arithmetic (AVX2 machines), torch's bf16 matmul costs grow linearly
with the number of rows, which makes verifying K drafts cost about K decode steps. The kernel in
``bf16_gemv.cpp`` reads each weight row once for up to 16 input rows. It is compiled on first use
(about a minute, cached by torch in ~/.cache/torch_extensions); if that fails, or on CPUs without
AVX2/FMA, or with ``VERISPEC_KERNELS=0``, everything runs on torch's own ``F.linear``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MAX_ROWS = 16
_state: dict[str, object] = {}


def _load() -> object | None:
    if "module" in _state:
        return _state["module"]
    module = None
    if os.environ.get("VERISPEC_KERNELS", "1") == "0":
        log.info("VERISPEC_KERNELS=0: using torch's bf16 matmul")
    elif torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("CPU lacks AVX2/FMA: using torch's bf16 matmul")
    else:
        try:
            from torch.utils.cpp_extension import load

            log.info("loading verispec's bf16 kernel (compiled on first use only: about a minute)")
            module = load("verispec_bf16_gemv", [str(Path(__file__).with_name("bf16_gemv.cpp"))],
                          extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
        except Exception as exc:  # no compiler, no ninja: slower, still correct
            log.warning("could not compile verispec's bf16 kernel (%s); using torch's bf16 matmul", exc)
    _state["module"] = module
    return module


def available() -> bool:
    return _load() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for activations of any float dtype against weights of another (result in x's dtype).

    bf16 weights and at most ``MAX_ROWS`` rows take the compiled path; everything else torch's.
    """
    if weight.dtype is torch.bfloat16 and x.numel() // x.shape[-1] <= MAX_ROWS and x.shape[-1] % 8 == 0:
        module = _load()
        if module is not None and weight.is_contiguous():
            out = module.bf16_linear(x, weight)
            return out if bias is None else out + bias
    if x.dtype is weight.dtype and (bias is None or bias.dtype is weight.dtype):
        return F.linear(x, weight, bias)
    out = F.linear(x.to(weight.dtype), weight).to(x.dtype)  # e.g. a bf16 prefill; biases stay fp32
    return out if bias is None else out + bias


class Linear(torch.nn.Linear):
    """nn.Linear whose forward goes through ``linear`` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of fp32 activations (one compiled call for decode-sized inputs)."""
    module = _load()
    if module is not None and x.dtype is weight.dtype is torch.float32 and x.numel() <= MAX_ROWS * 16384:
        return module.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused [..., 2 * intermediate] projection, gate first."""
    module = _load()
    if module is not None and gate_up.dtype is torch.float32 and gate_up.numel() <= MAX_ROWS * 65536:
        return module.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
