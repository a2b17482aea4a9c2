"""The verification curve: the cost of one forward pass over M = 1..16 new tokens on a 256-token cache,
relative to M = 1, for each model and weight format, measured side by side in one run.

    python benchmarks/verify_curve.py --models qwen2.5-coder-1.5b qwen2.5-coder-0.5b --threads 2

Speculative decoding pays when verifying K+1 tokens costs about one decode step; this prints what
it costs here. Also the prefill of ``--prefill`` tokens (time to first token), per format, and
transformers' bf16 prefill of the same tokens for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec import load_model
from verispec.bench.engines import load_hf
from verispec.bench.runner import cpu_name

FORMATS = {"bf16": dict(dtype="bfloat16"), "int8": dict(dtype="bfloat16", quantize="int8")}


def timed(fn, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - begin)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--prefill", type=int, default=700)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = list(range(1, 17))
    print(f"CPU: {cpu_name()} (torch capability {torch.backends.cpu.get_cpu_capability()}), {args.threads} threads; "
          f"a pass over M new tokens on a {args.context}-token cache, median of {args.repeats}")
    print("| model | format | M=1 ms | " + " | ".join(f"M={m}" for m in rows[1:]) + f" | prefill {args.prefill} tok: s (tok/s) |")
    print("|---|---|---|" + "---|" * (len(rows) - 1) + "---|")
    for name in args.models:
        for fmt in args.formats:
            model = load_model(name, **FORMATS[fmt])
            ids = torch.randint(0, model.config.vocab_size - 1000, (args.prefill + 16,),
                                generator=torch.Generator().manual_seed(0))
            cache = model.new_cache(max(args.context, args.prefill) + 16)
            model.forward(ids[: args.context], cache, 0)
            cost = {m: timed(lambda: model.forward(ids[args.context:args.context + m], cache, args.context), args.repeats)
                    for m in rows}
            prefill = timed(lambda: model.forward(ids[: args.prefill], cache, 0, last_only=True), 1)
            print(f"| {name} | {fmt} | {cost[1] * 1e3:.1f} | " + " | ".join(f"{cost[m] / cost[1]:.2f}x" for m in rows[1:])
                  + f" | {prefill:.2f} ({args.prefill / prefill:.0f}) |", flush=True)
            del model, cache
        hf = load_hf(name, torch.bfloat16)
        with torch.inference_mode():
            prefill = timed(lambda: hf(ids[: args.prefill][None]), 1)
        print(f"| {name} | transformers bf16 | | " + " | " * (len(rows) - 2) + f" | {prefill:.2f} ({args.prefill / prefill:.0f}) |",
              flush=True)
        del hf


if __name__ == "__main__":
    main()
