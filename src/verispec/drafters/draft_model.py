"""A separate, smaller model as the draft source (the classic speculative decoding setup)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from verispec.drafters.registry import DrafterSpec, Param
from verispec.drafters.base import DEFAULT_K, DraftContext, DrafterBase, Proposal, draft_token, stop_drafting
from verispec.errors import VerispecError
from verispec.models.protocol import DecoderModel

log = logging.getLogger(__name__)

FIXED_K = 5  # transformers' assisted generation beside it (no controller), when no K is given


def check_vocabularies(target: DecoderModel, draft: DecoderModel) -> str | None:
    """Identical vocabularies pass; ones that differ only in their number of rows (padding at the end)
    are reconciled by ``DraftModel`` (a warning text is returned when no tokenizers can confirm it).

    Anything else is an error: translating between tokenizers is not supported.
    """
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    if t_tok is not None and d_tok is not None:
        t_vocab, d_vocab = t_tok.get_vocab(), d_tok.get_vocab()
        if t_vocab != d_vocab:
            raise VerispecError("the draft model's tokenizer differs from the target's; speculative decoding "
                                "needs one shared vocabulary (translation between tokenizers is not supported)")
        real = max(t_vocab.values()) + 1
        for model in (target, draft):
            if model.config.vocab_size < real:
                raise VerispecError(f"a model's embedding ({model.config.vocab_size} rows) is smaller than its "
                                    f"tokenizer's vocabulary ({real})")
    elif target.config.vocab_size != draft.config.vocab_size:
        return (f"vocabulary sizes differ (target {target.config.vocab_size}, draft {draft.config.vocab_size}) and "
                "no tokenizers can show they agree; assuming the extra rows are padding")
    return None


class DraftModel(DrafterBase):
    """Draft with a separate model that has its own KV cache.

    Candidates are sampled autoregressively under the same sampling transform as the target. The
    draft cache holds the committed tokens it has already seen; before proposing, the ones it has
    not (the last recovered/bonus token, and an accepted final draft it never fed) go in one pass.

    Vocabularies may differ in padding rows. The draft never proposes a token the target lacks (those
    rows are masked); a token the target emits that lies past the draft's rows is fed to the draft
    as a stand-in (id 0). That changes only what the draft conditions on, never the acceptance rule,
    so the output law stays the target's.
    """

    method = "draft-model"

    def __init__(self, model: DecoderModel, k: int | str = DEFAULT_K) -> None:
        super().__init__(k)
        if not isinstance(model, DecoderModel):
            raise VerispecError(f"DraftModel takes a model from verispec.load_model, got {type(model).__name__}")
        self.model = model
        self.cache = None
        self.cached = 0  # committed tokens whose KV the draft cache holds
        self._warned: set[int] = set()  # targets already warned about (once each, not every run)

    def settings(self) -> dict[str, Any]:
        return {"method": self.method, "draft": self.model.name or "draft", "k": self.k,
                "draft_quantization": getattr(self.model, "quantization", None)}

    def start(self, context: DraftContext) -> None:
        warning = check_vocabularies(context.target, self.model)
        if warning and id(context.target) not in self._warned:
            self._warned.add(id(context.target))
            log.warning(warning)
        self.vocab = context.target.config.vocab_size
        self.rows = self.model.config.vocab_size
        self.cache = self.model.new_cache(context.cache.capacity)  # the draft writes no further than the target
        self.cached = 0

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [T, draft_vocab] -> [T, target_vocab]: padding rows masked or added as -inf."""
        extra = self.vocab - logits.shape[-1]
        if extra < 0:
            return logits[:, : self.vocab]
        if extra > 0:
            return torch.cat([logits, logits.new_full((logits.shape[0], extra), float("-inf"))], dim=-1)
        return logits

    def propose(self, context: DraftContext, k: int) -> Proposal:
        tokens, sampling = context.tokens, context.sampling
        self.base = len(tokens)
        if self.cached >= len(tokens):  # proposing again from the same tokens (k="auto" measuring costs)
            self.cached = len(tokens) - 1
            self.cache.rollback(self.cached)
        feed = torch.tensor(tokens[self.cached:])  # usually 1 or 2 tokens; the whole prompt at first
        feed = torch.where(feed < self.rows, feed, 0)  # a target token past the draft's rows: a stand-in
        tokens_out, probs_out = [], []
        for _ in range(k):
            logits = self._fit_vocab(self.model.forward(feed, self.cache, self.cached, last_only=True))  # [1, vocab]
            self.cached += feed.numel()
            token, probs = draft_token(logits[0], sampling, context.generator)
            if probs is not None:
                probs_out.append(probs)
            tokens_out.append(token)
            feed = torch.tensor([token])
            if stop_drafting(context, logits[0], token, probs):
                break
        # The last candidate is never fed: the draft cache now holds tokens plus candidates[:-1].
        return Proposal(torch.tensor(tokens_out, dtype=torch.long), torch.stack(probs_out) if probs_out else None,
                        draft_calls=len(tokens_out))

    def accepted(self, num_accepted: int) -> None:
        self.cached = min(self.cached, self.base + num_accepted)
        self.cache.rollback(self.cached)


def _quantized(params: dict[str, Any]) -> str:
    scheme = params.get("draft_quantize", "none")
    return "" if scheme == "none" else f" ({scheme})"


SPEC = DrafterSpec(
    name="draft-model", summary="a separate, smaller model with its own KV cache",
    params=(Param("draft", "str", "Draft model (same forms as --model).", required=True, flag="--draft", selects=True),
            Param("draft_quantize", "str", "Quantize the draft model's weights (int8); the target is unaffected.",
                  flag="--draft-quantize", choices=("none", "int8"))),
    build=lambda p, k, load: DraftModel(load(p["draft"], quantize=p.get("draft_quantize")),
                                        k=DEFAULT_K if k is None else k),
    describe=lambda p, target: f"{p['draft']}{_quantized(p)} -> {target}",
    fixed_k=FIXED_K, model_params=("draft",),
    per_request=False,
)
