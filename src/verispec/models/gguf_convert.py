"""Turn a GGUF file into a Hugging Face folder (config.json, model.safetensors, tokenizer) once.

Dequantizing a GGUF takes 15-45 s, so the result is kept in the user cache keyed by the file's
sha256; the converted folder is a plain HF checkpoint that both backends (and transformers) load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verispec.errors import VerispecError
from verispec.paths import cache_dir

log = logging.getLogger(__name__)

_TENSOR_NAMES = {  # GGUF block tensor -> HF name inside model.layers.{i}
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def converted_folder(gguf_path: Path, sha256: str | None = None) -> Path:
    """The HF folder for ``gguf_path``, converting it on first use."""
    sha256 = sha256 or sha256_file(gguf_path)
    target = cache_dir() / "converted" / sha256[:16]
    if (target / "model.safetensors").exists():
        return target
    log.info("converting %s to safetensors (once; cached in %s)", gguf_path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        _convert(gguf_path, staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)  # atomic: a cache folder is complete or absent
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf_path: Path, out: Path) -> None:
    import gguf
    from safetensors.torch import save_file

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except (ValueError, OSError, IndexError, KeyError) as exc:  # bad magic, truncated file, unknown type
        raise VerispecError(f"{gguf_path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    hf_config = _hf_config(reader)
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            continue
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        weights = weights.reshape([int(d) for d in reversed(tensor.shape)] if weights.ndim > 1 else -1)
        if hf_config["model_type"] == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = hf_config["num_attention_heads"] if ".q_proj." in name else hf_config["num_key_value_heads"]
            weights = _undo_llama_cpp_rope_permutation(weights, heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(weights))
    hf_config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    _save_tokenizer(gguf_path, out)


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        mapped = _TENSOR_NAMES.get(parts[2])
        return None if mapped is None else f"model.layers.{parts[1]}.{mapped}.{parts[3]}"
    mapped = _TOP_NAMES.get(parts[0])
    return None if mapped is None else f"{mapped}.{parts[1]}"


def _undo_llama_cpp_rope_permutation(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp interleaves the rotary halves of Llama q/k rows; put them back in HF order."""
    half = weights.shape[0] // heads // 2
    w = weights.reshape(heads, half, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_config(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise VerispecError(f"GGUF architecture '{arch}' is not supported by the native converter; "
                            "load it with backend='hf'")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "attention_bias": arch == "qwen2",
        "_name_or_path": str(_field(reader, "general.name", "")),
    }
    if arch == "llama":
        config["mlp_bias"] = False
    return config


def _save_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # a GGUF without a usable tokenizer still generates from token ids
        log.warning("no tokenizer could be read from %s (%s); token ids only", gguf_path.name, exc)
        return
    tokenizer.save_pretrained(str(out))
