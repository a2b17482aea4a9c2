from verispec.drafters.base import DraftContext, Drafter, Proposal
from verispec.drafters.draft_model import DraftModel
from verispec.drafters.low_rank import LowRank
from verispec.drafters.prompt_lookup import PromptLookup
from verispec.drafters.self_speculative import EarlyExit, LayerSkip

__all__ = ["DraftContext", "DraftModel", "Drafter", "EarlyExit", "LayerSkip", "LowRank", "PromptLookup", "Proposal"]
