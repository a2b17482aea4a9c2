"""Draft sources, each behind the ``Drafter`` protocol, and the registry that builds them by name."""

from verispec.drafters import draft_model, low_rank, prompt_lookup, quantized, self_speculative
from verispec.drafters.base import DraftContext, Drafter, DrafterBase, Proposal
from verispec.drafters.draft_model import DraftModel
from verispec.drafters.low_rank import LowRank
from verispec.drafters.prompt_lookup import PromptLookup
from verispec.drafters.quantized import QuantizedDraft
from verispec.drafters.registry import DRAFTERS, DrafterChoice, DrafterSpec, Param, make_choice, parse_drafter, register
from verispec.drafters.self_speculative import EarlyExit, LayerSkip

# The built-in drafters: one line each (a new drafter adds its module and one line here).
register(draft_model.SPEC)
register(self_speculative.LAYER_SKIP)
register(self_speculative.EARLY_EXIT)
register(low_rank.SPEC)
register(prompt_lookup.SPEC)
register(quantized.SPEC)

__all__ = ["DRAFTERS", "DraftContext", "DraftModel", "Drafter", "DrafterBase", "DrafterChoice", "DrafterSpec",
           "EarlyExit", "LayerSkip", "LowRank", "Param", "PromptLookup", "Proposal", "QuantizedDraft", "make_choice", "parse_drafter",
           "register"]
