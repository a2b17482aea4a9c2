"""The verification curve: the cost of one forward pass over M = 1..16 new tokens on a 256-token cache,
relative to M = 1, for each model and weight format, measured side by side in one run.

    python benchmarks/verify_curve.py --models qwen2.5-coder-1.5b qwen2.5-coder-0.5b --threads 2

Speculative decoding pays when verifying K+1 tokens costs about one decode step; this prints what
it costs here. Then the prefill (time to first token) of the Spec-Bench summarization prompt whose
length is nearest ``--prefill`` tokens (random tokens when the shared data is absent), in each format
and in transformers' bf16, interleaved ``--prefill-repeats`` times so that each ratio is measured side
by side. ``--no-curve`` measures the prefill alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec import load_model
from verispec.kernels import median_seconds
from verispec.bench.engines import load_hf
from verispec.bench.runner import cpu_name
from verispec.bench.workloads import spec_bench
from verispec.errors import VerispecError

FORMATS = {"bf16": dict(dtype="bfloat16"), "int8": dict(dtype="bfloat16", quantize="int8")}


def summarization_prompt(tokenizer, length: int) -> tuple[torch.Tensor, str]:
    """The token ids of the Spec-Bench summarization prompt nearest ``length`` tokens (raw text, no chat
    template), or ``length`` random tokens without the shared data."""
    try:
        prompts = spec_bench(1000, "summarization", None)
    except VerispecError:
        ids = torch.randint(0, tokenizer.vocab_size - 1000, (length,), generator=torch.Generator().manual_seed(0))
        return ids, f"{length} random tokens (no Spec-Bench data found)"
    encoded = [(p, tokenizer.encode(p.text, add_special_tokens=False)) for p in prompts]
    prompt, ids = min(encoded, key=lambda pair: abs(len(pair[1]) - length))
    return torch.tensor(ids), f"Spec-Bench summarization prompt {prompt.id}, {len(ids)} tokens"


def prefill_table(name: str, formats: list[str], target: int, repeats: int) -> None:
    """Prefill of one prompt in each format and in transformers' bf16, the formats taking turns."""
    models = {fmt: load_model(name, **FORMATS[fmt]) for fmt in formats}
    hf = load_hf(name, torch.bfloat16)
    ids, what = summarization_prompt(next(iter(models.values())).tokenizer, target)
    prefills = {fmt: (lambda m=model, c=model.new_cache(len(ids) + 1): m.forward(ids, c, 0, last_only=True))
                for fmt, model in models.items()}
    prefills["transformers bf16"] = lambda: hf(ids[None], logits_to_keep=1)  # what its generate() computes
    runs: dict[str, list[float]] = {fmt: [] for fmt in prefills}
    with torch.inference_mode():
        for turn in range(repeats + 1):  # the first turn warms up
            for fmt, prefill in prefills.items():
                begin = time.perf_counter()
                prefill()
                if turn:
                    runs[fmt].append(time.perf_counter() - begin)
    base = statistics.median(runs["transformers bf16"])
    print(f"\n{name}: prefill of the {what}, median of {repeats} (formats taking turns)")
    print("| format | prefill s (tok/s) | runs (s) | vs transformers bf16 |")
    print("|---|---|---|---|")
    for fmt, times in runs.items():
        median = statistics.median(times)
        print(f"| {fmt} | {median:.2f} ({len(ids) / median:.0f}) | {', '.join(f'{t:.2f}' for t in times)} "
              f"| {base / median:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--prefill", type=int, default=700, help="prompt length to look for (tokens)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--no-curve", dest="curve", action="store_false", help="measure the prefill alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()} (torch capability {torch.backends.cpu.get_cpu_capability()}), {args.threads} threads")
    if args.curve:
        rows = list(range(1, 17))
        print(f"\nA pass over M new tokens on a {args.context}-token cache, median of {args.repeats}")
        print("| model | format | M=1 ms | " + " | ".join(f"M={m}" for m in rows[1:]) + " |")
        print("|---|---|---|" + "---|" * (len(rows) - 1))
        for name in args.models:
            for fmt in args.formats:
                model = load_model(name, **FORMATS[fmt])
                ids = torch.randint(0, model.config.vocab_size - 1000, (args.context + 16,),
                                    generator=torch.Generator().manual_seed(0))
                cache = model.new_cache(args.context + 16)
                model.forward(ids[: args.context], cache, 0)
                cost = {m: median_seconds(lambda: model.forward(ids[args.context:args.context + m], cache, args.context),
                                          args.repeats) for m in rows}
                print(f"| {name} | {fmt} | {cost[1] * 1e3:.1f} | "
                      + " | ".join(f"{cost[m] / cost[1]:.2f}x" for m in rows[1:]) + " |", flush=True)
                del model, cache
    for name in args.models:
        prefill_table(name, args.formats, args.prefill, args.prefill_repeats)


if __name__ == "__main__":
    main()
