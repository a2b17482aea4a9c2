"""The two engines a benchmark drives: verispec's own loop, and transformers' generate (plain,
assisted generation with an assistant model, and prompt lookup) measured the same way. Both return a
``GenerationResult`` whose ``GenerationStats`` is the run's one record."""

from __future__ import annotations

import time
from typing import Any

import torch

from verispec.bench.config import BenchConfig, Setting
from verispec.bench.workloads import Prompt
from verispec.decoding import Generation, GenerationResult, encode_prompt
from verispec.errors import VerispecError
from verispec.models.loading import load_model, parse_dtype
from verispec.models.protocol import DecoderModel
from verispec.sampling import SamplingConfig
from verispec.stats import GenerationStats


class Engines:
    """Models and drafters, loaded once per benchmark and shared by every run."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        # One target per quantization compared; the first is the one prompts are encoded with.
        self.targets = {q: load_model(config.target, dtype=config.dtype, quantize=q) for q in config.quantize}
        self.target = self.targets[config.quantize[0]]
        self.models: dict[tuple[str, str | None], DecoderModel] = {}  # draft models, shared by the settings using them
        self.drafters = {s.label: s.choice.build(self.load) for s in config.settings if s.choice is not None}
        self.hf_target = None
        self.hf_drafts: dict[str, Any] = {}
        for setting in config.settings:
            if setting.engine != "transformers":
                continue
            if self.hf_target is None:
                self.hf_target = load_hf(config.target, parse_dtype(config.dtype))
            draft = setting.params.get("draft")
            if draft is not None and draft not in self.hf_drafts:
                self.hf_drafts[draft] = load_hf(draft, parse_dtype(config.dtype))

    def load(self, name: str, quantize: str | None = None) -> DecoderModel:
        if (name, quantize) not in self.models:
            self.models[name, quantize] = load_model(name, dtype=self.config.dtype, quantize=quantize)
        return self.models[name, quantize]

    def run(self, setting: Setting, prompt_ids: list[int], sampling: SamplingConfig, max_new_tokens: int,
            seed: int) -> GenerationResult:
        sampling = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        if setting.engine == "transformers":
            assistant = self.hf_drafts.get(setting.params.get("draft"))
            return run_transformers(self.hf_target, assistant, self.target.tokenizer, prompt_ids, sampling, setting,
                                    max_new_tokens, self.config.ignore_eos, seed)
        return self.start(setting, prompt_ids, sampling, max_new_tokens, seed).result()

    def start(self, setting: Setting, prompt_ids: list[int], sampling: SamplingConfig, max_new_tokens: int,
              seed: int) -> Generation:
        """A verispec run not yet stepped: iterate it step by step, or call ``result()`` to run it whole."""
        if setting.engine != "verispec":
            raise VerispecError(f"{setting.label} runs transformers' generate, which cannot be stepped")
        sampling = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        return Generation(self.targets[setting.quantize], input_ids=prompt_ids, max_new_tokens=max_new_tokens,
                          sampling=sampling, drafter=self.drafters.get(setting.label), acceptance=setting.acceptance,
                          ignore_eos=self.config.ignore_eos, logprobs=True,  # every method pays it alike
                          prefill_chunk=self.config.prefill_chunk or None)


def prompt_ids(model: DecoderModel, prompt: Prompt, chat: str) -> tuple[list[int], bool]:
    """The prompt's token ids, and whether the chat template wrapped it."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise VerispecError(f"{model.name} has no tokenizer: benchmarks need text prompts")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    use_chat = not prompt.completion and (chat == "always" or (chat == "auto" and has_template))
    if use_chat and not has_template:
        raise VerispecError(f"chat = 'always' but {model.name}'s tokenizer has no chat template")
    return encode_prompt(model, prompt.text, chat=use_chat), use_chat


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every matrix once; of an embedding table one row,
    counted as nothing, unless the head shares it (then the whole table, once). int8 matrices are
    buffers (weights, scales, sums): counted at their own sizes."""
    names: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, param in tensors:
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    return sum(p.numel() * p.element_size() for i, p in params.items() if any("embed" not in n for n in names[i]))


class _CallMeter:
    """Counts a module's forward calls and times them (forward pre/post hooks)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls, self.seconds, self._t0 = 0, 0.0, 0.0
        self.first_end: float | None = None
        self.first_seconds = 0.0
        self.handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, *_: Any) -> None:
        self._t0 = time.perf_counter()

    def _post(self, *_: Any) -> None:
        now = time.perf_counter()
        self.calls += 1
        self.seconds += now - self._t0
        if self.first_end is None:
            self.first_end, self.first_seconds = now, now - self._t0

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


def _generate_kwargs(setting: Setting, sampling: SamplingConfig, assistant: Any, tokenizer: Any,
                     max_new_tokens: int, ignore_eos: bool) -> dict[str, Any]:
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
    return kwargs


def run_transformers(model: Any, assistant: Any, tokenizer: Any, prompt_ids: list[int], sampling: SamplingConfig,
                     setting: Setting, max_new_tokens: int, ignore_eos: bool, seed: int) -> GenerationResult:
    """transformers' generate with the same prompt ids, sampling and length; calls counted by hooks.

    What transformers does not expose stays None in the stats: prompt lookup's proposed candidates
    (so its drafted tokens and acceptance rate), its drafting time, and acceptance by position.
    """
    kwargs = _generate_kwargs(setting, sampling, assistant, tokenizer, max_new_tokens, ignore_eos)
    input_ids = torch.tensor([prompt_ids])
    target_meter = _CallMeter(model)
    draft_meter = _CallMeter(assistant) if setting.method == "hf-assisted" else None
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
    stats = GenerationStats(
        method=setting.method, engine="transformers", k=setting.k, exact=True,
        settings={"method": setting.method, "engine": "transformers", **setting.params, **({"k": setting.k} if setting.k else {})},
        sampling=sampling.describe(), seed=seed, prompt_tokens=len(prompt_ids), new_tokens=len(new),
        target_calls=calls,
        # Each assistant forward pass proposes one candidate; prompt lookup's proposals are not exposed.
        draft_calls=draft_meter.calls if draft_meter is not None else 0,
        drafted_tokens=draft_meter.calls if draft_meter is not None else (None if drafting else 0),
        # Each target call commits its accepted candidates plus one token, so accepted = new - calls.
        accepted_tokens=len(new) - calls if drafting else 0,
        # The first assisted call prefills and verifies at once: a decode step (see GenerationStats).
        decode_steps=calls if drafting else calls - 1, decode_step_tokens=len(new) if drafting else len(new) - 1,
        drafted_by_position=None if drafting else [], accepted_by_position=None if drafting else [],
        wall_seconds=wall, prefill_seconds=target_meter.first_seconds,
        first_token_seconds=(target_meter.first_end or start) - start,
        draft_seconds=draft_meter.seconds if draft_meter is not None else (None if drafting else 0.0),
        verify_seconds=target_meter.seconds - target_meter.first_seconds,
    )
    finish = "length" if len(new) >= max_new_tokens else "eos"
    return GenerationResult(new, text, finish, stats, list(prompt_ids), logprobs)
