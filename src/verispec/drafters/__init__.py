from verispec.drafters.base import DraftContext, Drafter, Proposal
from verispec.drafters.draft_model import DraftModel
from verispec.drafters.prompt_lookup import PromptLookup

__all__ = ["DraftContext", "DraftModel", "Drafter", "PromptLookup", "Proposal"]
