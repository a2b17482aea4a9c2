"""The fast path, measured: decoder layers in one compiled call (``kernels/layers.cpp``) against the
layer-by-layer Python path, side by side in one process (``VERISPEC_FUSED_LAYERS`` switched between
interleaved repeats), for the cost of one pass over M new tokens and for whole runs.

    python benchmarks/fast_path.py --models smollm2-135m qwen2.5-coder-1.5b --threads 2

Both paths give the same bits (tests/test_fused_layers.py); this shows what the Python work cost.
Also the per-token target log-probability (``generate(logprobs=True)``), which runs only when asked.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import verispec
from verispec import kernels
from verispec.machine import cpu_name

PROMPT = ('from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n'
          '    """ Check if in given list of numbers, are any two numbers closer to each other than\n'
          '    given threshold.\n    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n'
          '    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)\n    True\n    """\n')


def with_stack(fused: bool, fn):
    """``fn`` run with the compiled stack on or off."""
    def run():
        os.environ["VERISPEC_FUSED_LAYERS"] = "1" if fused else "0"
        return fn()
    return run


def interleaved(arms: dict, repeats: int) -> dict:
    """Median seconds of each arm, the arms alternating (so drift on a shared machine hits all alike)."""
    runs = {name: [] for name in arms}
    for fn in arms.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in arms.items():
            begin = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - begin)
    return {name: statistics.median(r) for name, r in runs.items()}


def both(fn, repeats: int) -> dict[bool, float]:
    return interleaved({True: with_stack(True, fn), False: with_stack(False, fn)}, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-1.5b"])
    parser.add_argument("--quantize", default="int8", choices=["int8", "none"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quantize = None if args.quantize == "none" else args.quantize
    rows = (1, 2, 3, 4, 8, 16)
    print(f"CPU: {cpu_name()} (torch capability {torch.backends.cpu.get_cpu_capability()}), {args.threads} threads, "
          f"weights {args.quantize}; int8 path by rows: "
          + ", ".join(f"{m}: {kernels.int8_path(m)}" for m in (1, 2, 4, 8, 16)))
    print(f"\nOne pass over M new tokens on a {args.context}-token cache, ms (median of {args.repeats}): "
          "compiled stack / Python path\n")
    print("| model | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    models = {}
    for name in args.models:
        model = models[name] = verispec.load_model(name, dtype="bfloat16", quantize=quantize)
        ids = torch.randint(0, model.config.vocab_size - 1000, (args.context + 16,),
                            generator=torch.Generator().manual_seed(0))
        cache = model.new_cache(args.context + 16)
        model.forward(ids[: args.context], cache, 0)
        cells = []
        for m in rows:
            t = both(lambda: model.forward(ids[args.context:args.context + m], cache, args.context), args.repeats)
            cells.append(f"{t[True] * 1e3:.1f} / {t[False] * 1e3:.1f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nWhole runs, {args.tokens} new tokens on a HumanEval prompt, greedy: tok/s, compiled stack / Python path "
          f"(median of {args.repeats}), and the cost of logprobs=True\n")
    print("| model | plain | prompt lookup K=2 | lookup's speedup over plain | logprobs=True |")
    print("|---|---|---|---|---|")
    for name, model in models.items():
        def run(drafter=None, logprobs=False):
            return lambda: verispec.generate(model, PROMPT, max_new_tokens=args.tokens, ignore_eos=True,
                                             drafter=drafter, logprobs=logprobs)
        plain = both(run(), args.repeats)
        lookup = both(run(verispec.PromptLookup(ngram=3, k=2)), args.repeats)
        logprobs = interleaved({False: with_stack(True, run()), True: with_stack(True, run(logprobs=True))}, args.repeats)
        rate = {f: args.tokens / t for f, t in plain.items()}
        look = {f: args.tokens / t for f, t in lookup.items()}
        print(f"| {name} | {rate[True]:.1f} / {rate[False]:.1f} ({plain[False] / plain[True]:.2f}x) | "
              f"{look[True]:.1f} / {look[False]:.1f} | {look[True] / rate[True]:.2f}x / {look[False] / rate[False]:.2f}x | "
              f"{logprobs[True] / logprobs[False]:.3f}x the time (stack on) |")


if __name__ == "__main__":
    main()
