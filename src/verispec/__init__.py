"""verispec: exact speculative and self-speculative decoding, measured honestly.

The public names below are imported on first use (PEP 562), so ``import verispec`` is cheap and
modules that only read results (``verispec.bench.records``, ``verispec.bench.report``) never pull in
torch or the model runtime.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "AcceptanceRule": "acceptance", "ExactRule": "acceptance", "LenientRule": "acceptance", "TopKRule": "acceptance",
    "TypicalRule": "acceptance", "Verdict": "acceptance", "exact_verify": "acceptance", "greedy_verify": "acceptance",
    "parse_rule": "acceptance",
    "Generation": "decoding", "GenerationResult": "decoding", "Step": "decoding", "generate": "decoding",
    "stream": "decoding",
    "DraftContext": "drafters", "Drafter": "drafters", "DrafterBase": "drafters", "DraftModel": "drafters",
    "EarlyExit": "drafters", "LayerSkip": "drafters", "LowRank": "drafters", "PromptLookup": "drafters",
    "QuantizedDraft": "drafters", "Proposal": "drafters", "make_choice": "drafters", "parse_drafter": "drafters", "register": "drafters",
    "DrafterSpec": "drafters", "Param": "drafters",
    "VerispecError": "errors",
    "load_model": "models",
    "SamplingConfig": "sampling", "logits_to_probs": "sampling",
    "GenerationStats": "stats",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'verispec' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"verispec.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
