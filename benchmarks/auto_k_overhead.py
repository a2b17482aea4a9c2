"""What k="auto"'s controller costs a step in Python: its three calls timed apart, synthetic and in real runs.

A run of prompt lookup on the int8 SmolLM2-135M takes ~9 ms a step (verification) on these CPUs, and
every step also runs ``AutoK.choose`` (before drafting), ``AutoK.cut`` (on the proposal's ratings) and
``AutoK.observe`` (after the step; its time is in no stats field, only in the run's wall time). A bench
run's "other" seconds mix the controller with the loop's own bookkeeping; this times the controller
alone, on a synthetic run whose proposals, ratings and acceptances are drawn from a seeded generator
(a rated proposal of K_MAX candidates a step, each kept with the probability its rating says, the
chain ending at the first rejection), priced with a verification curve of the shape measured for
int8 SmolLM2-135M.

    python benchmarks/auto_k_overhead.py              # microseconds a step, per call and in all
    python benchmarks/auto_k_overhead.py --runs 50    # more runs (the median of per-run means is printed)
    python benchmarks/auto_k_overhead.py --model smollm2-135m --quantize int8   # also in place, in real runs

In place (``--model``), the same three calls are timed inside real runs of prompt lookup with
``k="auto"`` on a HumanEval-style prompt: there they run right after a target pass, with the
interpreter's caches cold, and cost several times what the synthetic loop shows.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from verispec import adaptive

# seconds, 1..16 rows (int8 SmolLM2-135M on an AMX Xeon, BENCHMARKS.md section 27, rounded; the shape
# matters here only as far as it changes which branches the controller takes)
VERIFY = [0.0043, 0.0049, 0.0059, 0.0061, 0.0061, 0.0061, 0.0065, 0.0067, 0.0075, 0.0077, 0.0079, 0.0081,
          0.0083, 0.0085, 0.0087, 0.0089]


def one_run(rng: random.Random, new_tokens: int, prompt: int) -> tuple[int, float, float, float]:
    """Steps of one synthetic run and the seconds spent in choose, cut and observe."""
    auto = adaptive.AutoK("both")
    auto.curve = adaptive.CostCurve(verify=list(VERIFY), draft=[0.0] + [2e-5] * adaptive.K_MAX, overhead=4e-4,
                                    context=prompt, attention=1e-9)
    tokens = [0] * (prompt + 1)
    auto._tokens = tokens
    spent = [0.0, 0.0, 0.0]
    steps, committed, clock = 0, 1, time.perf_counter
    while committed < new_tokens:
        t0 = clock()
        ask = auto.choose(new_tokens - committed - 1)
        t1 = clock()
        proposed = 0
        ratings: list[float] = []
        if ask:
            ratings = [rng.random() for _ in range(min(ask, adaptive.K_MAX))]
            t2 = clock()
            proposed = auto.cut(ratings)
            spent[1] += clock() - t2
        accepted = 0
        while accepted < proposed and rng.random() < ratings[accepted]:
            accepted += 1
        step = accepted + 1
        verify = VERIFY[proposed]
        t3 = clock()
        auto.observe(ask, proposed, accepted, step, 2e-5 * proposed, verify, 4e-4)
        spent[2] += clock() - t3
        spent[0] += t1 - t0
        tokens.extend([0] * step)
        committed += step
        steps += 1
    return steps, *spent


def in_place(model_name: str, quantize: str | None, runs: int, new_tokens: int) -> dict[str, float]:
    """Microseconds a step of choose, cut and observe inside real prompt-lookup runs with k="auto"
    (each call wrapped in a timer; greedy, the prompt of ``benchmarks/fast_path.py``)."""
    import verispec
    from verispec.drafters.prompt_lookup import PromptLookup

    sys.path.insert(0, str(Path(__file__).parent))
    from fast_path import PROMPT

    spent = {"choose": 0.0, "cut": 0.0, "observe": 0.0}
    originals = {name: getattr(adaptive.AutoK, name) for name in spent}

    def timed(name):
        original = originals[name]

        def call(self, *args, **kwargs):
            began = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - began
        return call

    model = verispec.load_model(model_name, dtype="bfloat16", quantize=quantize)
    steps = 0
    try:
        for name in spent:
            setattr(adaptive.AutoK, name, timed(name))
        for run in range(runs + 1):  # the first warms up (and measures the cost curve)
            if run == 1:
                spent = dict.fromkeys(spent, 0.0)
                steps = 0
            result = verispec.generate(model, PROMPT, max_new_tokens=new_tokens, drafter=PromptLookup(k="auto"),
                                       ignore_eos=True)
            steps += result.stats.decode_steps
    finally:
        for name, original in originals.items():
            setattr(adaptive.AutoK, name, original)
    out = {name: 1e6 * value / steps for name, value in spent.items()}
    out["all"] = sum(out.values())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="synthetic runs (default 30)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens a run commits (default 128)")
    parser.add_argument("--prompt", type=int, default=200, help="prompt positions (default 200)")
    parser.add_argument("--model", help="also time the calls in place, in real runs of this model (e.g. smollm2-135m)")
    parser.add_argument("--quantize", choices=["int8", "none"], default="int8", help="the model's weights (default int8)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.new_tokens < 2 or args.prompt < 1:
        parser.error("--runs and --prompt must be >= 1, --new-tokens >= 2")
    rng = random.Random(0)
    one_run(rng, args.new_tokens, args.prompt)  # warm the interpreter's caches
    per = {"choose": [], "cut": [], "observe": [], "all": []}
    for _ in range(args.runs):
        steps, choose, cut, observe = one_run(rng, args.new_tokens, args.prompt)
        for name, value in (("choose", choose), ("cut", cut), ("observe", observe), ("all", choose + cut + observe)):
            per[name].append(1e6 * value / steps)
    print(f"k='auto' controller, microseconds a step (median of {args.runs} runs' means, "
          f"{args.new_tokens} tokens each, synthetic prompt-lookup proposals):")
    for name, values in per.items():
        print(f"  {name:8s} {statistics.median(values):7.1f}")
    if args.model:
        import torch

        from verispec.machine import cpu_name

        quantize = None if args.quantize == "none" else args.quantize
        place = in_place(args.model, quantize, min(args.runs, 5), args.new_tokens)
        print(f"in place: {args.model} ({args.quantize}), prompt lookup k='auto', greedy, {cpu_name()}, "
              f"{torch.get_num_threads()} threads, microseconds a step:")
        for name, value in place.items():
            print(f"  {name:8s} {value:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
