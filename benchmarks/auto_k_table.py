"""Issue 13's goal checks from a `verispec bench` results file.

Per decoding mode and setting: the median per-prompt end-to-end speedup over plain decoding on each
workload, over all runs, and their geometric mean; predicted over achieved (decode) speedup, median and
runs within 15%; runs below 0.97x; runs with the same tokens as plain (greedy, and sampled where the
records say: position-keyed sampling); steps without speculation. Then, for
each `k="auto"` setting with fixed-K settings of the same drafter beside it: the gap to the best fixed K
on each workload (goal: within 5%) and on the mix (goal: ahead of every fixed K).

    python benchmarks/auto_k_table.py results/auto-k-every-k-bf16-smollm2.jsonl
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections import defaultdict

WORKLOADS = ["humaneval", "math_reasoning", "mt_bench", "qa", "rag", "summarization", "translation"]


def fmt(x: float) -> str:
    """Two decimals, three where a ratio falls below the goal's 0.97 (so 0.9699 does not read 0.97)."""
    return f"{x:.3f}" if x < 0.975 else f"{x:.2f}"


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def drafter_of(setting: str) -> str:
    return setting.split(" K=")[0]


def k_of(setting: str) -> str:
    """The K part of a setting's label ("K=3"), wherever it stands ("... K=3 @int8")."""
    found = re.search(r"K=\S+", setting)
    return found.group(0) if found else setting


def main(path: str) -> None:
    with open(path) as f:
        records = [r for r in map(json.loads, f) if r["type"] == "record" and r["method"] != "plain"]
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["mode"], r["setting"])].append(r)
    print("| mode | setting | " + " | ".join(WORKLOADS) + " | all | geomean | pred/ach | within 15% | < 0.97 | lowest "
          "| identical | plain steps |")
    print("|" + "---|" * (len(WORKLOADS) + 10))
    summary: dict[str, dict[str, tuple[dict[str, float], float, float]]] = defaultdict(dict)
    for (mode, setting), runs in sorted(groups.items()):
        by_workload = defaultdict(list)
        for r in runs:
            by_workload[r["workload"].split("/")[-1]].append(r["speedup"])
        medians = {w: statistics.median(v) for w, v in by_workload.items()}
        speedups = [r["speedup"] for r in runs]
        ratios = [r["predicted_speedup"] / r["decode_speedup"] for r in runs
                  if r.get("predicted_speedup") and r.get("decode_speedup")]
        identical = [r.get("same_tokens_as_plain", r["identical_to_plain"]) for r in runs
                     if r.get("same_tokens_as_plain") is not None or r["mode"] == "greedy"]
        plain = [(r["plain_steps"], r["decode_steps"]) for r in runs if r.get("plain_steps") is not None]
        cells = [fmt(medians[w]) if w in medians else "-" for w in WORKLOADS]
        cells += [fmt(statistics.median(speedups)), f"{geomean(speedups):.3f}",
                  f"{statistics.median(ratios):.3f}" if ratios else "",
                  f"{sum(abs(x - 1) <= 0.15 for x in ratios)}/{len(ratios)}" if ratios else "",
                  f"{sum(x < 0.97 for x in speedups)}/{len(speedups)}", f"{min(speedups):.3f}",
                  f"{sum(identical)}/{len(identical)}" if identical else "",
                  f"{sum(a for a, _ in plain)}/{sum(b for _, b in plain)}" if plain else ""]
        print(f"| {mode} | {setting} | " + " | ".join(cells) + " |")
        summary[mode][setting] = (medians, geomean(speedups), statistics.median(speedups))
    for mode, settings in summary.items():
        for auto in (s for s in settings if "K=auto" in s):
            fixed = [s for s in settings if "K=auto" not in s and drafter_of(s) == drafter_of(auto)]
            if not fixed:
                continue
            medians, geo, median = settings[auto]
            gaps = []
            for w in (w for w in WORKLOADS if w in medians):
                best = max(fixed, key=lambda s: settings[s][0].get(w, 0.0))
                gaps.append((w, medians[w] / settings[best][0][w] - 1, k_of(best)))
            print(f"\n{mode} {auto}: within 5% of the best fixed K on {sum(g >= -0.05 for _, g, _ in gaps)}/{len(gaps)}; "
                  + "; ".join(f"{w} {g:+.1%} vs {k}" for w, g, k in gaps))
            best = max(fixed, key=lambda s: settings[s][1])
            print(f"  mix: geomean auto {geo:.3f} vs best fixed {k_of(best)} {settings[best][1]:.3f}; median auto "
                  f"{median:.3f} vs " + ", ".join(f"{k_of(s)} {settings[s][2]:.3f}" for s in fixed))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
