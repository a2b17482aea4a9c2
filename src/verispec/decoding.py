"""The one decoding loop. Plain decoding is this loop with no drafter; every drafter plugs into it.

Invariant between steps: ``tokens`` holds every committed token; the target's KV cache holds all
of them except the last, which the next target call feeds together with the drafts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Iterator, Sequence

import torch

from verispec.acceptance import greedy_verify, parse_rule
from verispec.adaptive import CURVE_ROWS, AutoK, auto_mode, is_auto
from verispec.drafters.base import DraftContext, Drafter, Proposal
from verispec.errors import VerispecError
from verispec.models.protocol import DecoderModel
from verispec.sampling import SamplingConfig, check_logits, logits_to_probs, position_uniform
from verispec.stats import GenerationStats
from verispec.validation import is_int, positive_int

log = logging.getLogger(__name__)


_PREFILLING = object()  # ``_run`` between two chunks of the prefill (see Generation.advance)
_ENDED = object()


@dataclasses.dataclass(frozen=True)
class Step:
    """What one decoding step committed."""

    token_ids: list[int]
    text: str  # the new text ("" without a tokenizer)
    drafted: int
    accepted: int


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only (an EOS that ended the run included)
    text: str | None
    finish_reason: str  # "eos", "length" or "stop"
    stats: GenerationStats
    prompt_ids: list[int]
    # log p_target(token) at T=1 per new token, with ``logprobs=True`` only (empty otherwise)
    target_logprobs: list[float] = dataclasses.field(default_factory=list)


def _tokenizer(model: DecoderModel) -> Any:
    if model.tokenizer is None:
        raise VerispecError("this model has no tokenizer: pass input_ids instead of a text prompt")
    return model.tokenizer


def encode_prompt(model: DecoderModel, prompt: str, chat: bool = False) -> list[int]:
    """A text prompt's token ids; ``chat`` wraps it as one user message in the model's chat template."""
    if chat:
        return encode_messages(model, [{"role": "user", "content": prompt}])
    return list(_tokenizer(model).encode(prompt))


def encode_messages(model: DecoderModel, messages: list[dict[str, str]]) -> list[int]:
    """A conversation through the model's chat template, with the assistant's turn opened."""
    tokenizer = _tokenizer(model)
    if not getattr(tokenizer, "chat_template", None):
        raise VerispecError("this model's tokenizer has no chat template: give a plain prompt (no --chat; "
                            "the server's /v1/completions)")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # a template may refuse a conversation (roles out of order, ...)
        raise VerispecError(f"the model's chat template refused these messages: {exc}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


# Special tokens that end a generation whichever one the config names as EOS (llama.cpp treats the same
# texts as end-of-generation; transformers lists them in generation_config.json, which GGUF files lack):
# a Qwen instruct model's config names <|im_end|>, yet in code completion it ends text with <|endoftext|>.
END_OF_GENERATION = ("<|endoftext|>", "<|im_end|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>",
                     "<|end|>")


def eos_ids(model: DecoderModel) -> set[int]:
    """The token ids that end a run: the config's EOS (which ``load_model`` extends with
    generation_config.json's), the tokenizer's, and the special tokens in ``END_OF_GENERATION`` the
    tokenizer defines."""
    ids = set(model.config.eos_token_ids)
    tokenizer = model.tokenizer
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        special = getattr(tokenizer, "get_added_vocab", dict)()
        ids.update(int(special[text]) for text in END_OF_GENERATION if text in special)
    return {i for i in ids if isinstance(i, int) and 0 <= i < model.config.vocab_size}


class _Text:
    """Incremental detokenisation and stop-string detection."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.ids: list[int] = []
        self.emitted = ""
        self.searched = 0  # characters of the text already searched for stop strings

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def hits_stop(self, token: int) -> bool:
        """Add ``token``; True when a stop string now appears in the output.

        The whole text is decoded (a window of tokens misses stops spread over tokens that decode to
        nothing, or to parts of one character); only its new end is searched.
        """
        self.ids.append(token)
        if not self.stop:
            return False
        text = self.decode(self.ids)
        start = max(0, self.searched - max(map(len, self.stop)) + 1)
        self.searched = len(text)
        return any(s in text[start:] for s in self.stop)

    def full(self) -> str:
        text = self.decode(self.ids)
        cuts = [text.find(s) for s in self.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def delta(self, final: bool = False) -> str:
        """The text added since the last call. Until the run ends (``final``), an incomplete multi-byte
        character and any end of the text that could still grow into a stop string are held back, so a
        stream never shows part of a stop string that the final text then cuts."""
        text = self.full()
        if not final:
            if text.endswith("\ufffd"):
                return ""
            text = text[: len(text) - self._stop_prefix(text)]
        if len(text) <= len(self.emitted):
            return ""
        new, self.emitted = text[len(self.emitted):], text
        return new

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest end of ``text`` that is the beginning of a stop string."""
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)


def _token_ids(input_ids: Any) -> list[int]:
    """A list (or 1-D integer tensor / array) of token ids -> list[int]; anything else is an error."""
    if isinstance(input_ids, torch.Tensor) or hasattr(input_ids, "dtype"):  # torch tensor or numpy array
        if input_ids.ndim != 1 or not str(input_ids.dtype).removeprefix("torch.").startswith(("int", "uint")):
            raise VerispecError(f"input_ids must be a 1-D sequence of integer token ids, got a {input_ids.ndim}-D "
                                f"{str(input_ids.dtype).removeprefix('torch.')} array")
        return [int(t) for t in input_ids.tolist()]
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
        raise VerispecError(f"input_ids must be a sequence of integer token ids, got {type(input_ids).__name__}")
    if not all(is_int(t) for t in input_ids):
        bad = next(t for t in input_ids if not is_int(t))
        raise VerispecError(f"input_ids must be integer token ids, got {bad!r}")
    return list(input_ids)


class Generation:
    """A decoding run: iterate it for ``Step`` records (streaming), then call ``result()``.

    The run happens once: iterating again, or calling ``result()`` after breaking out of a loop over
    it, continues where it stopped (never restarts)."""

    def __init__(self, model: DecoderModel, prompt: str | None = None, *, input_ids: Sequence[int] | None = None,
                 max_new_tokens: int = 128, sampling: SamplingConfig | None = None,
                 drafter: Drafter | None = None, stop: Sequence[str] | str | None = None,
                 chat: bool = False, acceptance: Any = None, ignore_eos: bool = False, logprobs: bool = False,
                 prefill_chunk: int | None = None) -> None:
        if not isinstance(model, DecoderModel):
            raise VerispecError(f"model must come from verispec.load_model (a DecoderModel), got {type(model).__name__}")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise VerispecError(f"drafter must implement verispec.Drafter (subclass verispec.DrafterBase), "
                                f"got {type(drafter).__name__}")
        self.model, self.drafter = model, drafter
        # k="auto": a controller chooses K per step from measured costs and acceptance
        self.auto = AutoK(auto_mode(drafter.k)) if drafter is not None and is_auto(drafter.k) else None
        self.acceptance = parse_rule(acceptance)
        self.sampling = sampling or SamplingConfig()
        if not isinstance(self.sampling, SamplingConfig):
            raise VerispecError("sampling must be a verispec.SamplingConfig")
        self.max_new_tokens = positive_int(max_new_tokens, "max_new_tokens")
        self.prompt_ids = self._prompt_ids(prompt, input_ids, chat)
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stop):
            raise VerispecError("stop strings must be non-empty")
        if stop and model.tokenizer is None:
            raise VerispecError("stop strings need a tokenizer; this model has none")
        self.text = _Text(model.tokenizer, stop)
        self.eos = set() if ignore_eos else eos_ids(model)  # ignore_eos: fixed-length runs for benchmarks
        context = model.config.max_position_embeddings
        if len(self.prompt_ids) + max_new_tokens > context:
            raise VerispecError(f"prompt ({len(self.prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                                f"exceeds the model's context of {context} tokens")
        seed = self.sampling.resolved_seed()
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        settings = drafter.settings() if drafter is not None else {"method": "plain"}
        self.stats = GenerationStats(method=settings["method"], settings=settings,
                                     k=drafter.k if drafter is not None else 0,
                                     sampling=self.sampling.describe(), seed=seed,
                                     prompt_tokens=len(self.prompt_ids), exact=self.acceptance.exact)
        self.stats.settings.update(self.acceptance.settings())
        # What "exact" is exact to: the target as loaded (its weights' dtype, and int8 if quantized).
        self.stats.settings["quantization"] = getattr(model, "quantization", None)
        self.finish_reason: str | None = None
        self.new_ids: list[int] = []
        self.target_logprobs: list[float] = []
        self.logprobs = bool(logprobs)  # one logsumexp over the vocabulary per token: only when asked for
        # The prompt's prefill in passes of at most this many positions (None: one pass). Lockstep timing
        # (verispec.bench.interleave) steps runs chunk by chunk through their prefills, as it does
        # through their decoding steps.
        self.prefill_chunk = None if prefill_chunk is None else positive_int(prefill_chunk, "prefill_chunk")
        self.prefilled = 0  # prompt positions in the target's cache so far
        self._events = self._run()  # the one generator every iteration, advance() and result() share
        self._steps = (event for event in self._events if event is not _PREFILLING)

    def _prompt_ids(self, prompt: str | None, input_ids: Sequence[int] | None, chat: bool) -> list[int]:
        if (prompt is None) == (input_ids is None):
            raise VerispecError("give exactly one of prompt (text) or input_ids")
        ids = encode_prompt(self.model, prompt, chat) if prompt is not None else _token_ids(input_ids)
        if not ids:
            raise VerispecError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise VerispecError(f"input_ids must lie in [0, {vocab})")
        return ids

    def _commit(self, new: list[int], drafted: int, accepted: int, logits: torch.Tensor) -> Step:
        """Commit ``new`` (cut at EOS / stop / length); ``logits`` [len(new), vocab] are the target's rows
        that chose them, kept as log-probabilities for quality checks when the run asked for them."""
        kept: list[int] = []
        for token in new:
            kept.append(token)
            if token in self.eos:
                self.finish_reason = "eos"
            elif self.text.hits_stop(token):
                self.finish_reason = "stop"
            elif len(self.new_ids) + len(kept) >= self.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        self.new_ids.extend(kept)
        if self.logprobs:
            rows = logits[: len(kept)].float()
            chosen = rows.gather(1, torch.tensor(kept).view(-1, 1)).squeeze(1) - rows.logsumexp(-1)
            self.target_logprobs.extend(chosen.tolist())
        self.stats.new_tokens = len(self.new_ids)
        text = self.text.delta(final=self.finish_reason is not None) if self.text.tokenizer is not None else ""
        return Step(kept, text, drafted, min(accepted, len(kept)))  # drafts cut by a stop were never emitted

    def __iter__(self) -> Iterator[Step]:
        return self._steps

    def advance(self) -> bool:
        """Run one decoding step, or one chunk of the prefill; False once the run has ended."""
        return next(self._events, _ENDED) is not _ENDED

    def _run(self) -> Iterator[Any]:  # Steps, and _PREFILLING between prefill chunks
        model, stats, drafter = self.model, self.stats, self.drafter
        start = time.perf_counter()
        tokens = list(self.prompt_ids)
        # The last committed token is never fed, so no pass writes past position prompt + max_new - 2.
        capacity = len(tokens) + self.max_new_tokens - 1
        if self.auto is not None:  # room for the calibration's longest pass however short the run, within the context
            limits = (model.config.max_position_embeddings, getattr(model.config, "sliding_window", None))
            capacity = max(capacity, min([len(tokens) + CURVE_ROWS] + [n for n in limits if n]))
        cache = model.new_cache(capacity)
        # 1. Prefill: target calls over the prompt (one, or one per prefill_chunk positions) give the first
        #    new token. Its time is the run's own: a chunk's pass, not what ran between chunks.
        chunk = self.prefill_chunk or len(tokens)
        own, resumed = 0.0, start  # the prefill's seconds before the current chunk; when it began
        for begin in range(0, len(tokens), chunk):
            if begin:
                own += time.perf_counter() - resumed
                yield _PREFILLING  # advance() returns here; iterating the run never sees it
                resumed = time.perf_counter()
            end = min(begin + chunk, len(tokens))
            logits = model.forward(torch.tensor(tokens[begin:end]), cache, begin, last_only=True)  # [1, vocab]
            stats.target_calls += 1
            self.prefilled = end
        first = self._verify(torch.empty(0, dtype=torch.long), None, logits).next_token
        stats.prefill_seconds = stats.first_token_seconds = own + time.perf_counter() - resumed
        tokens.append(first)
        yield self._commit([first], 0, 0, logits[-1:])
        context = DraftContext(tokens, model, cache, self.sampling, self.generator)
        auto = self.auto
        if drafter is not None and not self.finish_reason:
            drafter.start(context)
            stats.settings.update(drafter.settings())  # now with what start() derived (ranks, ...)
            if auto is not None:
                # the cost curve: measured here (judging each pass as the loop does, on a generator of
                # its own: the run's random stream is untouched), or cached
                judge_with = torch.Generator().manual_seed(0)
                auto.start(model, drafter, context, lambda d, q, logits: self._verify(d, q, logits, judge_with))
                context.keep_drafting = auto.keep_drafting if auto.wants_confidence else None
        stats.k_histogram = {}
        while not self.finish_reason:
            begin = time.perf_counter()
            n = len(tokens)
            # 2. Draft: never more candidates than the token budget can still use (k="auto": the
            #    controller's choice, 0 when no K is predicted to beat plain decoding).
            budget = self.max_new_tokens - len(self.new_ids) - 1
            if drafter is None:
                k = 0
            else:
                k = auto.choose(budget) if auto is not None else min(drafter.k, budget)
            t0 = time.perf_counter()
            proposal = drafter.propose(context, k) if k > 0 else Proposal(torch.empty(0, dtype=torch.long), None)
            if k > 0 and proposal.confidence is not None and auto is not None and auto.wants_confidence:
                proposal = proposal.prefix(auto.cut(proposal.confidence))  # rated candidates: keep what pays
            t1 = time.perf_counter()
            # 3. Verify: one target call over the last committed token and the K candidates.
            inputs = torch.tensor([tokens[-1]] + proposal.tokens.tolist())  # [K+1]
            if k > 0:
                logits = drafter.target_logits(context, inputs)  # [K+1, vocab]
            else:
                logits = model.forward(inputs, cache, n - 1)  # [1, vocab]
            verdict = self._verify(proposal.tokens, proposal.probs, logits)
            # 4. Roll back: the caches keep the committed tokens only.
            cache.rollback(n + verdict.num_accepted)
            if drafter is not None and k > 0:
                drafter.accepted(verdict.num_accepted)
            t2 = time.perf_counter()
            new = proposal.tokens[: verdict.num_accepted].tolist() + [verdict.next_token]
            tokens.extend(new)
            stats.target_calls += 1
            stats.draft_calls += proposal.draft_calls
            stats.draft_seconds += t1 - t0
            stats.verify_seconds += t2 - t1
            step = self._commit(new, proposal.tokens.numel(), verdict.num_accepted, logits)
            stats.record_step(step.drafted, step.accepted, len(step.token_ids))
            stats.k_histogram[k] = stats.k_histogram.get(k, 0) + 1
            if auto is not None:
                other = (time.perf_counter() - t2) + (t0 - begin)
                auto.observe(k, proposal.tokens.numel(), verdict.num_accepted, len(step.token_ids), t1 - t0,
                             t2 - t1, other)
                if self.finish_reason:
                    auto.finish()
                    stats.record_auto(auto.report())
            yield step
        stats.wall_seconds = time.perf_counter() - start

    def _verify(self, drafts: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                generator: torch.Generator | None = None):
        check_logits(logits, "the target model")
        if self.sampling.greedy:
            return getattr(self.acceptance, "verify_greedy", greedy_verify)(drafts, logits)
        probs = logits_to_probs(logits, self.sampling)
        if generator is None and draft_probs is None and getattr(self.acceptance, "coupled", False):
            # A deterministic draft (or none) under the exact rule: the token at each output position is
            # drawn with that position's own uniform, so plain sampling and prompt lookup at any K (auto
            # included) commit the same tokens for a seed. The calibration's passes judge with their own
            # generator and read none of these.
            start, seed = len(self.new_ids), self.seed
            return self.acceptance.verify_coupled(drafts, probs, lambda i: position_uniform(seed, start + i))
        return self.acceptance.verify(drafts, draft_probs, probs, self.generator if generator is None else generator)

    def result(self) -> GenerationResult:
        for _ in self._events:  # finish the run (nothing left to do once it has ended)
            pass
        text = self.text.full() if self.text.tokenizer is not None else None
        return GenerationResult(self.new_ids, text, self.finish_reason, self.stats, self.prompt_ids,
                                self.target_logprobs)


def stream(model: DecoderModel, prompt: str | None = None, **kwargs: Any) -> Generation:
    """Like ``generate`` but returns the run: iterate it for ``Step`` records as tokens are produced."""
    return Generation(model, prompt, **kwargs)


def generate(model: DecoderModel, prompt: str | None = None, *, input_ids: Sequence[int] | None = None,
             max_new_tokens: int = 128, sampling: SamplingConfig | None = None, drafter: Drafter | None = None,
             stop: Sequence[str] | str | None = None, chat: bool = False, acceptance: Any = None,
             ignore_eos: bool = False, logprobs: bool = False, prefill_chunk: int | None = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens; ``drafter=None`` is plain autoregressive decoding.

    ``acceptance`` is the rule that judges drafts: a ``verispec.acceptance`` rule or its spec string
    ('exact' (default), 'lenient:0.5', 'typical:0.09', 'topk:3'); approximate rules mark the stats.
    ``ignore_eos`` generates exactly ``max_new_tokens`` (benchmarks compare equal lengths).
    ``logprobs`` fills ``result.target_logprobs`` (log p_target of each new token at T=1, for quality
    checks; one logsumexp over the vocabulary per token, about 0.5% of a SmolLM2 step).
    ``prefill_chunk`` prefills the prompt in passes of at most that many positions (None: one pass).
    """
    return Generation(model, prompt, input_ids=input_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                      drafter=drafter, stop=stop, chat=chat, acceptance=acceptance, ignore_eos=ignore_eos,
                      logprobs=logprobs, prefill_chunk=prefill_chunk).result()
