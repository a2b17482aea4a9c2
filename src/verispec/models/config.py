"""The architecture description the native runtime needs, read from HF config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from verispec.errors import VerispecError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer hyper-parameters (Llama / Qwen2 / Mistral family)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # Qwen2 puts a bias on q/k/v
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    sliding_window: int | None = None  # Mistral: attention span; the native runtime attends to everything

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json_file(cls, path: Path) -> "ModelConfig":
        data = json.loads(Path(path).read_text())
        data["eos_token_ids"] = tuple(data.get("eos_token_ids") or ())
        return cls(**data)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Read a transformers config.json (LlamaConfig, Qwen2Config, MistralConfig)."""
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise VerispecError(
                f"the native runtime covers {', '.join(SUPPORTED_ARCHITECTURES)}; this checkpoint is "
                f"'{model_type or 'unknown'}'. Load it with backend='hf' (CLI: --backend hf)."
            )
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_params = hf.get("rope_scaling") or hf.get("rope_parameters") or None
        rope_theta = hf.get("rope_theta") or (rope_params or {}).get("rope_theta") or 10000.0
        return cls(
            architecture=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=_normalise_rope_scaling(rope_params),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=hf.get("_name_or_path", ""),
            sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", model_type == "mistral") else None,
        )


def _normalise_rope_scaling(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """Keep only a real scaling (not the transformers-5 'default' entry that merely carries rope_theta)."""
    if not params:
        return None
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    return {**params, "rope_type": kind}
