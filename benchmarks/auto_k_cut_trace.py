"""Trace prompt lookup's cut under k="auto": what each rated proposal's first candidate was worth and cost.

Runs prompt lookup with ``k="auto"`` over a bench config's prompts (its target, first quantization,
workloads and prompt count) at one temperature, records at every ``AutoK.cut`` the acceptance estimate
of each candidate (``Acceptance.by_confidence``), the price of its verified row in tokens at the
yardstick rate, what was kept and what the target accepted, then prints (1) first candidates by
confidence: how many were cut or kept and how often the kept ones were accepted, and (2) the row price
and cuts in stretches of 60 proposals (a prompt's worth, about). Diagnostic only; it times nothing.

    python benchmarks/auto_k_cut_trace.py benchmarks/configs/auto-k-every-k-int8-smollm2.toml --prompts 2
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch

import verispec
from verispec import adaptive
from verispec.bench.config import load_config
from verispec.bench.engines import Engines
from verispec.bench.runner import _encode
from verispec.drafters.prompt_lookup import PromptLookup
from verispec.sampling import SamplingConfig


def trace(config_path: str, prompts: int, temperature: float, ngram: int) -> list[dict]:
    config = load_config(config_path, prompts=prompts)
    torch.set_num_threads(config.threads or torch.get_num_threads())
    engines = Engines(config)
    model = engines.targets[config.quantize[0]]
    log: list[dict] = []
    cut, observe = adaptive.AutoK.cut, adaptive.AutoK.observe

    def traced_cut(self, confidence):
        estimates = [self.acceptance.by_confidence(c) for c in confidence[:adaptive.K_MAX]]
        keep = cut(self, confidence)
        bought = self.verify_scale * self._rate
        log.append({"confidence": list(confidence[:adaptive.K_MAX]), "estimates": estimates, "keep": keep,
                    "row_tokens": (self._verify(2) - self._verify(1)) * bought})
        return keep

    def traced_observe(self, asked, proposed, accepted, *args, **kwargs):
        if log and "accepted" not in log[-1]:
            log[-1]["accepted"] = accepted
        return observe(self, asked, proposed, accepted, *args, **kwargs)

    adaptive.AutoK.cut, adaptive.AutoK.observe = traced_cut, traced_observe
    try:
        for _, ids, _ in _encode(engines, config):
            verispec.generate(model, input_ids=ids, max_new_tokens=config.max_new_tokens, ignore_eos=True,
                              drafter=PromptLookup(ngram=ngram, k="auto"),
                              sampling=SamplingConfig(temperature=temperature))
    finally:
        adaptive.AutoK.cut, adaptive.AutoK.observe = cut, observe
    return [entry for entry in log if entry["confidence"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a verispec bench config (target, quantization, workloads)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per workload (default 2)")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    parser.add_argument("--ngram", type=int, default=3, help="prompt lookup's n-gram (default 3)")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.temperature <= 0:
        parser.error("--prompts must be >= 1 and --temperature > 0 (greedy: use auto_k_replay.py)")
    log = trace(args.config, args.prompts, args.temperature, args.ngram)
    first: dict[float, list[int]] = defaultdict(lambda: [0, 0, 0])  # cut, kept, kept and accepted
    for entry in log:
        counts = first[round(entry["confidence"][0], 2)]
        kept = entry["keep"] > 0
        counts[0 if not kept else 1] += 1
        counts[2] += kept and entry.get("accepted", 0) > 0
    print("first candidate by confidence: cut, kept, accepted of kept, median estimate")
    for c in sorted(first):
        cut_n, kept_n, accepted = first[c]
        estimate = statistics.median(e["estimates"][0] for e in log if round(e["confidence"][0], 2) == c)
        print(f"  {c:.2f}: {cut_n:4d} {kept_n:4d} {accepted / kept_n if kept_n else float('nan'):6.2f} {estimate:6.2f}")
    print("stretches of 60 proposals: row price in tokens (median, min, max), first candidates cut, median estimate")
    for i in range(0, len(log), 60):
        part = log[i:i + 60]
        rows = [e["row_tokens"] for e in part]
        print(f"  {i:5d}: {statistics.median(rows):6.3f} {min(rows):6.3f} {max(rows):6.3f} "
              f"{sum(e['keep'] == 0 for e in part):3d} {statistics.median(e['estimates'][0] for e in part):5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
