"""The two engines a benchmark drives: verispec's own loop, and transformers' generate (plain,
assisted generation with an assistant model, and prompt lookup) measured the same way."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from verispec.bench.config import Setting
from verispec.decoding import Generation
from verispec.errors import VerispecError
from verispec.sampling import SamplingConfig


@dataclasses.dataclass
class Outcome:
    """One measured run. Fields that an engine cannot observe stay None (never estimated)."""

    token_ids: list[int]
    text: str
    target_logprobs: list[float]
    wall_seconds: float
    first_token_seconds: float
    target_calls: int
    draft_calls: int | None
    drafted_tokens: int | None
    accepted_tokens: int | None
    mean_accepted_length: float  # new tokens per target call after the first (plain: 1.0)
    acceptance_by_position: list[float] | None
    draft_seconds: float | None
    verify_seconds: float | None
    exact: bool
    settings: dict[str, Any]


def make_drafter(setting: Setting) -> Any:
    from verispec import drafters

    p, k = setting.params, setting.k
    if setting.method == "draft-model":
        raise AssertionError("draft models are built by the runner (the model is shared)")
    if setting.method == "layer-skip":
        skip = p.get("skip", [])
        return drafters.LayerSkip(skip if isinstance(skip, str) else [int(i) for i in skip], k=k,
                                  skip_attention=p.get("skip_attention", ()) or (), skip_mlp=p.get("skip_mlp", ()) or ())
    if setting.method == "early-exit":
        return drafters.EarlyExit(p["layer"], k=k)
    if setting.method == "low-rank":
        return drafters.LowRank(rank=p.get("rank"), energy=p.get("energy"), k=k,
                                targets=tuple(p.get("targets", ("attention", "mlp"))))
    if setting.method == "prompt-lookup":
        return drafters.PromptLookup(ngram=p.get("ngram", 3), k=k)
    raise AssertionError(setting.method)


def run_verispec(model: Any, drafter: Any, prompt_ids: list[int], sampling: SamplingConfig, setting: Setting,
                 max_new_tokens: int, ignore_eos: bool) -> Outcome:
    run = Generation(model, input_ids=prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                     drafter=drafter, acceptance=setting.acceptance, ignore_eos=ignore_eos)
    result = run.result()
    s = result.stats
    drafting = drafter is not None
    return Outcome(result.token_ids, result.text or "", result.target_logprobs, s.wall_seconds, s.first_token_seconds,
                   s.target_calls, s.draft_calls if drafting else None, s.drafted_tokens if drafting else None,
                   s.accepted_tokens if drafting else None, s.mean_accepted_length,
                   s.acceptance_rate_by_position if drafting else None,
                   s.draft_seconds if drafting else None, s.verify_seconds if drafting else None,
                   s.exact, dict(s.settings))


class _CallMeter:
    """Counts a module's forward calls and times them (forward pre/post hooks)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls, self.seconds, self.first_end, self._t0 = 0, 0.0, None, 0.0
        self.handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, *_: Any) -> None:
        self._t0 = time.perf_counter()

    def _post(self, *_: Any) -> None:
        now = time.perf_counter()
        self.calls += 1
        self.seconds += now - self._t0
        if self.first_end is None:
            self.first_end = now

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def load_hf(source: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    from verispec.models.loading import resolve_source

    try:
        return AutoModelForCausalLM.from_pretrained(str(resolve_source(source)), dtype=dtype).eval()
    except (OSError, ValueError) as exc:
        raise VerispecError(f"transformers cannot load {source}: {exc}") from None


def run_transformers(model: Any, assistant: Any, tokenizer: Any, prompt_ids: list[int], sampling: SamplingConfig,
                     setting: Setting, max_new_tokens: int, ignore_eos: bool, seed: int) -> Outcome:
    """transformers' generate with the same prompt ids, sampling and length; calls counted by hooks."""
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, return_dict_in_generate=True, output_logits=True,
                                  pad_token_id=(tokenizer.eos_token_id if tokenizer is not None else None) or 0)
    if ignore_eos:
        kwargs["min_new_tokens"] = max_new_tokens  # transformers' way to run to the full length
    if sampling.greedy:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p)
    if setting.method == "hf-assisted":
        assistant.generation_config.num_assistant_tokens = setting.k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0  # fixed K, like verispec's
        kwargs["assistant_model"] = assistant
    elif setting.method == "hf-prompt-lookup":
        kwargs.update(prompt_lookup_num_tokens=setting.k, max_matching_ngram_size=setting.params.get("ngram", 3))
    input_ids = torch.tensor([prompt_ids])
    target_meter = _CallMeter(model)
    draft_meter = _CallMeter(assistant) if assistant is not None and setting.method == "hf-assisted" else None
    torch.manual_seed(seed)
    try:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        wall = time.perf_counter() - start
    finally:
        target_meter.close()
        if draft_meter is not None:
            draft_meter.close()
    new = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [float(torch.log_softmax(row[0].float(), -1)[t]) for row, t in zip(out.logits, new)]
    text = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else ""
    calls = target_meter.calls
    drafting = setting.method != "hf-plain"
    # Each target call commits its accepted candidates plus one token, so accepted = new - calls.
    accepted = len(new) - calls if drafting else None
    drafted = draft_meter.calls if draft_meter is not None else None  # prompt lookup's candidates are not exposed
    settings = {"method": setting.method, "engine": "transformers", **setting.params}
    if setting.k:
        settings["k"] = setting.k
    return Outcome(new, text, logprobs, wall, (target_meter.first_end or start) - start, calls,
                   draft_meter.calls if draft_meter is not None else (0 if drafting else None), drafted, accepted,
                   # transformers' first assisted call verifies while it prefills: tokens per target call
                   len(new) / calls if drafting and calls else 1.0, None,
                   draft_meter.seconds if draft_meter is not None else None,
                   target_meter.seconds if drafting else None, True, settings)
