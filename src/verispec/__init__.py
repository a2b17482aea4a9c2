"""verispec: exact speculative and self-speculative decoding, measured honestly."""

from verispec.acceptance import (AcceptanceRule, ExactRule, LenientRule, TopKRule, TypicalRule, Verdict,
                                 exact_verify, greedy_verify, parse_rule)
from verispec.decoding import Generation, GenerationResult, Step, generate, stream
from verispec.drafters import DraftContext, Drafter, DraftModel, EarlyExit, LayerSkip, LowRank, PromptLookup, Proposal
from verispec.errors import VerispecError
from verispec.models import load_model
from verispec.sampling import SamplingConfig, logits_to_probs
from verispec.stats import GenerationStats

__version__ = "0.1.0"

__all__ = [
    "AcceptanceRule", "ExactRule", "LenientRule", "TopKRule", "TypicalRule", "parse_rule",
    "DraftContext", "DraftModel", "Drafter", "EarlyExit", "LayerSkip", "LowRank", "Generation", "GenerationResult", "GenerationStats", "PromptLookup", "Proposal",
    "SamplingConfig", "Step", "Verdict", "VerispecError", "exact_verify", "generate", "greedy_verify",
    "load_model", "logits_to_probs", "stream",
]
