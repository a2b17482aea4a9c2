"""``load_model``: local HF folders, GGUF files, hub ids and offline catalogue names, two backends."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from verispec.errors import VerispecError
from verispec.models import catalogue
from verispec.models.config import ModelConfig
from verispec.models.gguf_convert import converted_folder
from verispec.models.protocol import DecoderModel
from verispec.models.quantize import check_scheme, quantize_model
from verispec.models.transformer import Transformer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
BACKENDS = ("native", "hf")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise VerispecError(f"unknown dtype '{dtype}'; use one of {', '.join(DTYPES)}") from None


def resolve_source(source: str | Path) -> Path:
    """A catalogue name, GGUF file, HF folder or hub id -> a local HF folder."""
    text = str(source)
    if text in catalogue.CATALOGUE:
        entry = catalogue.CATALOGUE[text]
        return converted_folder(catalogue.fetch(text), entry.sha256)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return converted_folder(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise VerispecError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.exists():
        raise VerispecError(f"{path} is neither a .gguf file nor a model folder")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text):
        return _download_from_hub(text)
    raise VerispecError(f"no model at '{text}': give a folder, a .gguf file, a hub id (org/name) "
                        f"or one of: {', '.join(catalogue.CATALOGUE)}")


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]))
    except Exception as exc:  # offline, unknown repo, gated repo: all are the user's to fix
        raise VerispecError(
            f"could not download '{repo_id}' from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            "If the hub is unreachable, pass a local folder or .gguf file instead, or a catalogue name "
            f"({', '.join(catalogue.CATALOGUE)}; see `verispec models`)."
        ) from None


def load_tokenizer(folder: Path) -> Any | None:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((folder / n).exists() for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def load_model(source: str | Path, dtype: str | torch.dtype = "float32", backend: str = "native",
               quantize: str | None = None) -> DecoderModel:
    """Load a causal LM for decoding.

    ``source``: a local Hugging Face folder, a ``.gguf`` file (dequantized once and cached), a hub id
    ``org/name``, or a catalogue name (``verispec models``). ``backend="native"`` is verispec's lean
    runtime (Llama, Qwen2, Mistral); ``backend="hf"`` wraps any transformers causal LM.

    ``quantize="int8"`` (native backend) stores the layers' matrices and the LM head in int8 with
    per-row int8 activations (``verispec.models.quantize``); ``dtype`` then applies to the embedding.
    Exact speculative decoding is exact with respect to the model as loaded: the int8 model.
    """
    if backend not in BACKENDS:
        raise VerispecError(f"unknown backend '{backend}'; use one of {', '.join(BACKENDS)}")
    torch_dtype = parse_dtype(dtype)
    scheme = check_scheme(quantize)
    if scheme is not None and backend == "hf":
        raise VerispecError(f"quantize='{scheme}' needs the native backend; the hf backend runs transformers' "
                            "own weights (drop --quantize or use --backend native)")
    folder = resolve_source(source)
    tokenizer = load_tokenizer(folder)
    if backend == "hf":
        from verispec.models.hf_backend import HFModel

        model = HFModel.from_folder(folder, torch_dtype)
    else:
        model = load_native(folder, torch_dtype, scheme, name=str(source))
    # The attributes every ``DecoderModel`` declares: what it is called, its tokenizer, and its folder
    # (where derived data such as low-rank factors is cached).
    model.tokenizer, model.name, model.folder = tokenizer, str(source), folder
    extra = generation_eos(folder)
    if extra:
        eos = tuple(dict.fromkeys((*model.config.eos_token_ids, *extra)))
        model.config = dataclasses.replace(model.config, eos_token_ids=eos)
    return model


def generation_eos(folder: Path) -> tuple[int, ...]:
    """The end-of-sequence ids of ``folder``'s generation_config.json, which transformers stops on too
    (Hugging Face folders have one; GGUF conversions do not)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        log.warning("unreadable %s: its end-of-sequence tokens are not used", path)
        return ()
    eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return tuple(i for i in eos if isinstance(i, int) and not isinstance(i, bool))


def load_native(folder: Path, dtype: torch.dtype, quantize: str | None = None, name: str | None = None) -> Transformer:
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    state = native_state_dict(read_safetensors(folder), config)
    with torch.device("meta"):
        model = Transformer(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise VerispecError(f"checkpoint in {folder} does not match its config: missing {missing[:5]}, "
                            f"unexpected {unexpected[:5]}")
    model.eval().requires_grad_(False)
    if quantize is not None:  # from the checkpoint's own weights, before any cast
        model.folder, model.name = folder, name or str(folder)
        quantize_model(model, quantize)
    model.to_weight_dtype(dtype)
    _return_freed_memory()
    return model


def _return_freed_memory() -> None:
    """Give the memory freed while loading (fp32 copies of fused matrices) back to the operating system:
    glibc keeps freed heap pages otherwise, close to a gigabyte on the 1.5B model."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(f for f in folder.glob("*.safetensors") if not f.name.startswith("lowrank-"))
    if not files:
        raise VerispecError(f"no *.safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def native_state_dict(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers parameter names -> the native runtime's fused layout."""
    hf = {k.removeprefix("model.") if k.startswith("model.") else k: v for k, v in hf.items()}
    out = {"embed.weight": hf.pop("embed_tokens.weight"), "norm.weight": hf.pop("norm.weight")}
    if "lm_head.weight" in hf:
        out["lm_head.weight"] = hf.pop("lm_head.weight")
    for i in range(config.num_layers):
        p = f"layers.{i}."
        out[p + "attn_norm.weight"] = hf.pop(p + "input_layernorm.weight")
        out[p + "mlp_norm.weight"] = hf.pop(p + "post_attention_layernorm.weight")
        out[p + "qkv.weight"] = torch.cat([hf.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv"])
        if config.attention_bias:
            out[p + "qkv.bias"] = torch.cat([hf.pop(f"{p}self_attn.{n}_proj.bias") for n in "qkv"])
        out[p + "o.weight"] = hf.pop(p + "self_attn.o_proj.weight")
        out[p + "gate_up.weight"] = torch.cat([hf.pop(p + "mlp.gate_proj.weight"), hf.pop(p + "mlp.up_proj.weight")])
        out[p + "down.weight"] = hf.pop(p + "mlp.down_proj.weight")
    leftover = [k for k in hf if "rotary_emb" not in k]
    if leftover:
        raise VerispecError(f"unexpected tensors in the checkpoint: {leftover[:5]}")
    return out
