from verispec.drafters.base import DraftContext, Drafter, Proposal
from verispec.drafters.draft_model import DraftModel

__all__ = ["DraftContext", "DraftModel", "Drafter", "Proposal"]
