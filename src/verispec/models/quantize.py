"""int8 weights for the native runtime: a quantized target, and the int8 copies a quantized draft uses.

Scheme ``int8``: each matrix of a decoder layer (fused qkv, o, fused gate/up, down) and the LM head
gets per-output-channel symmetric int8 weights; activations are quantized per row (per token) at run
time; products accumulate in int32 and are rescaled in fp32 (``kernels.int8_linear``). Embeddings,
norms, attention and the KV cache stay as they are. Integer accumulation makes a row's logits the
same bits whatever other rows share its forward pass, so greedy speculative decoding of an int8
target equals plain greedy decoding of it token for token.

Quantized weights are cached on disk beside the converted weights (or in the verispec cache), keyed
by the source folder, its weight files, the scheme and the dtype quantized from; a cache file that
is unreadable, from another scheme or of the wrong shapes is rebuilt, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from verispec.errors import VerispecError
from verispec import kernels
from verispec.kernels import Int8Linear
from verispec.paths import cache_dir

log = logging.getLogger(__name__)

SCHEMES = ("int8",)
MATRICES = ("qkv", "o", "gate_up", "down")
FORMAT = 1  # bump when the stored layout changes: old files are then rebuilt


def check_scheme(quantize: str | None) -> str | None:
    """None (no quantization) or a known scheme; anything else is the user's error, said plainly."""
    if quantize is None or (isinstance(quantize, str) and quantize.lower() in ("none", "")):
        return None
    if isinstance(quantize, str) and quantize.lower() in SCHEMES:
        return quantize.lower()
    if isinstance(quantize, str) and quantize.lower() == "int4":
        raise VerispecError("quantize='int4' is not offered for targets: no int4 kernel here is both faster than "
                            "int8 and batch-invariant (see BENCHMARKS.md); use 'int8', or QuantizedDraft(bits=4) "
                            "for an int4 draft")
    raise VerispecError(f"unknown quantization {quantize!r}; use one of: none, {', '.join(SCHEMES)}")


def linear_names(model: Any) -> list[str]:
    """The quantized matrices of a native model, by module path."""
    names = [f"layers.{i}.{m}" for i in range(model.config.num_layers) for m in MATRICES]
    return names + ["lm_head"]


def _source_weight(model: Any, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    module = model.get_submodule(name)
    if isinstance(module, Int8Linear):
        raise VerispecError(f"{name} is already quantized")
    return module.weight, module.bias


def cache_path(model: Any, scheme: str) -> Path | None:
    """Where this model's quantized weights live on disk (None when the model has no folder)."""
    folder = getattr(model, "folder", None)
    if folder is None:
        return None
    folder = Path(folder)
    files = sorted((f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in folder.glob("*.safetensors")
                   if not f.name.startswith(("lowrank-", "quantized-")))
    key = json.dumps({"folder": str(folder.resolve()), "files": files, "scheme": scheme, "format": FORMAT,
                      "from": str(model.dtype), "shape": [model.config.num_layers, model.config.hidden_size,
                                                          model.config.vocab_size]})
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    base = folder / "quantized" if folder.resolve().is_relative_to(cache_dir().resolve()) else cache_dir() / "quantized"
    return base / f"{scheme}-{digest}.safetensors"


def _expected(model: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    shapes = {}
    for name in linear_names(model):
        weight, _ = _source_weight(model, name)
        out, inner = weight.shape
        shapes[f"{name}.weight"] = ((out, inner), torch.int8)
        shapes[f"{name}.scale"] = ((out,), torch.float32)
        shapes[f"{name}.row_sums"] = ((out,), torch.int32)
    return shapes


def _read(path: Path, model: Any, scheme: str) -> dict[str, torch.Tensor] | None:
    """The cached tensors if the file is whole and of this scheme and model; None (and why, logged) if not."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # truncated, garbage, not safetensors at all
        log.warning("quantized cache %s is unreadable (%s): rebuilding it", path, exc)
        return None
    if meta.get("scheme") != scheme or meta.get("format") != str(FORMAT):
        log.warning("quantized cache %s holds scheme %s format %s, not %s format %s: rebuilding it", path,
                    meta.get("scheme"), meta.get("format"), scheme, FORMAT)
        return None
    expected = _expected(model)
    if set(tensors) != set(expected) or any(tuple(tensors[k].shape) != s or tensors[k].dtype != d
                                            for k, (s, d) in expected.items()):
        log.warning("quantized cache %s does not match this model's shapes: rebuilding it", path)
        return None
    return tensors


def _write(path: Path, tensors: dict[str, torch.Tensor], scheme: str) -> None:
    """Write atomically: a half-written file never takes the cache's name."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"scheme": scheme, "format": str(FORMAT)})
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not cache quantized weights in %s (%s); they will be recomputed next time", path, exc)
    finally:
        tmp.unlink(missing_ok=True)


def quantized_linears(model: Any, scheme: str = "int8") -> dict[str, Int8Linear]:
    """int8 versions of the model's matrices (module path -> Int8Linear), from the disk cache or computed."""
    scheme = check_scheme(scheme) or "int8"
    path = cache_path(model, scheme)
    tensors = _read(path, model, scheme) if path is not None and path.exists() else None
    if tensors is None:
        log.info("quantizing %s to %s (once%s)", getattr(model, "name", "the model"), scheme,
                 f"; cached in {path}" if path else "")
        tensors = {}
        for name in linear_names(model):
            weight, _ = _source_weight(model, name)
            rows, scale, sums = kernels.quantize_weight(weight)  # stored as rows: any machine's layout
            tensors[f"{name}.weight"], tensors[f"{name}.scale"], tensors[f"{name}.row_sums"] = rows, scale, sums
        if path is not None:
            _write(path, tensors, scheme)
    out = {}
    for name in linear_names(model):
        _, bias = _source_weight(model, name)
        out[name] = Int8Linear(tensors[f"{name}.weight"], tensors[f"{name}.scale"], tensors[f"{name}.row_sums"],
                               None if bias is None else bias.detach().float())
    kernels.measure_row_counts(list(out.values()))  # which path for how many rows: once per process
    return out


def quantize_model(model: Any, scheme: str = "int8") -> Any:
    """Replace the model's matrices by their int8 versions in place (the float originals are freed)."""
    scheme = check_scheme(scheme)
    if scheme is None:
        return model
    linears = quantized_linears(model, scheme)
    for name, module in linears.items():
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, module)  # a tied LM head: the embedding keeps its float table for lookups
    model.quantization = scheme
    return model


def int8_bytes(linears: dict[str, nn.Module]) -> int:
    """Bytes of int8 weights, scales and sums in ``linears``."""
    return sum(b.numel() * b.element_size() for m in linears.values() for b in m.buffers()
               if b is not getattr(m, "bias", None))
