"""The lossiness dial: for each approximate acceptance rule, what it costs and what it buys.

    python benchmarks/lossiness.py --results results/lossiness-qwen.jsonl results/lossiness-smollm2.jsonl \
        --out docs/reports/lossiness

1. Exact divergence on tiny models: the law of the first 3 generated tokens by enumeration
   (verispec.divergence), total variation and KL(method || target) against the target's, for each
   rule over its parameter (a 2-layer random transformer with vocabulary 6, and a noisy copy of it
   as the draft; K = 2).
2. Real models: `verispec bench` results files (benchmarks/configs/lossiness-*.toml), one setting per
   rule parameter beside the exact rule: speedup over plain decoding, acceptance, the target's mean
   log-probability of sampled tokens relative to plain sampling, greedy agreement with plain greedy,
   chrF on Spec-Bench translation, HumanEval pass@1 (executed) and math answer accuracy.
Writes lossiness.md and one PNG per rule.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from verispec.acceptance import ExactRule, parse_rule
from verispec.bench.records import read_results, summarise
from verispec.divergence import divergence_table, model_next_probs
from verispec.sampling import SamplingConfig
from verispec.testing import perturbed, tiny_model  # the same tiny pair the tests use

GRIDS = {"lenient": ["lenient:1", "lenient:0.9", "lenient:0.7", "lenient:0.5", "lenient:0.4", "lenient:0.3", "lenient:0.1"],
         "typical": ["typical:0.5", "typical:0.3", "typical:0.2", "typical:0.1", "typical:0.05", "typical:0.02"],
         "topk": ["topk:1", "topk:2", "topk:3", "topk:4", "topk:5", "topk:6"]}
AXIS = {"lenient": "lenience l (1 = exact; lower is looser)", "typical": "epsilon (delta = sqrt(epsilon); lower is looser)",
        "topk": "k (higher is looser)"}


def parameter(rule: str) -> float:
    return float(rule.split(":")[1].split(",")[0])


def tiny_divergence() -> dict[float, list[dict]]:
    target = tiny_model(vocab=6, seed=2, layers=2)
    draft = perturbed(target, seed=102, scale=0.3)
    out = {}
    for temperature in (1.0, 0.7):
        sampling = SamplingConfig(temperature)
        p, q = model_next_probs(target, [1, 2], sampling), model_next_probs(draft, [1, 2], sampling)
        rules = [ExactRule()] + [parse_rule(r) for family in GRIDS.values() for r in family]
        out[temperature] = divergence_table(p, q, rules, k=2, length=3)
    return out


def pooled(records: list[dict], acceptance: str, mode: str) -> dict | None:
    """The bench summary of one rule's runs in one mode, all workloads together."""
    rows = [dict(r, workload="all") for r in records
            if r["acceptance"] == acceptance and r["k"] and (r["mode"] == "greedy") == (mode == "greedy")]
    if not rows:
        return None
    summaries = summarise(rows)
    if len(summaries) != 1:
        raise SystemExit(f"expected one setting per rule and mode, found {[s['setting'] for s in summaries]}")
    return summaries[0]


def fmt(summary: dict | None, key: str, spec: str) -> str:
    return "–" if summary is None or summary.get(key) is None else spec.format(summary[key])


def task_score(greedy: dict | None, sampled: dict | None, key: str) -> str:
    """'k/n / k/n (plain k/n / k/n)': HumanEval passes or correct math answers, greedy / sampled
    ('–' for a mode the results do not hold), with plain decoding's on the same prompts."""
    parts, plain = [], []
    for s in (greedy, sampled):
        n = s.get(f"{key}_n") if s else None
        parts.append(f"{round(s[f'{key}_rate'] * n)}/{n}" if n else "–")
        plain.append(f"{round(s[f'plain_{key}_rate'] * n)}/{n}" if n else "–")
    if parts == ["–", "–"]:
        return "–"
    return f"{' / '.join(parts)} (plain {' / '.join(plain)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", nargs="*", default=[], help="verispec bench results files")
    parser.add_argument("--out", default="results/lossiness")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tiny = tiny_divergence()
    runs = []
    for path in args.results:
        meta, records = read_results(path)
        runs.append((Path(path).name, meta, records))

    md = ["# The lossiness dial", "",
          "What each approximate acceptance rule does to the output distribution, and what it buys. "
          "Made by `python benchmarks/lossiness.py --results " + " ".join(f"results/{n}" for n, _, _ in runs)
          + f" --out {args.out}`, from `verispec bench` runs of `benchmarks/configs/lossiness-*.toml` (each "
          "results file is named in its section).", "",
          "Rules (see the README): **lenient:l** accepts with min(1, p/(l·q)) and samples max(0, p − l·q) on "
          "rejection; **typical:ε** keeps a draft outright when p(x) > min(ε, √ε·exp(−H(p))); **topk:k** keeps it "
          "outright when it is among the target's k most likely tokens. Typical and top-k leave every other draft "
          "to the exact test and the exact residual, so at one position the loss is exactly the draft's excess "
          "mass max(0, q − p) on the kept set. Under greedy decoding lenient equals exact (p is one-hot); typical "
          "and top-k judge with the untempered softmax and replace a rejection by the argmax.", "",
          "## 1. Exact divergence on a tiny model pair (enumeration, first 3 tokens, K = 2)", "",
          "A random 2-layer transformer (vocabulary 6) as the target and a noisy copy of it as the draft; "
          "TV = total variation, KL = KL(method ‖ target) in nats, from the exact law of every 3-token sequence "
          "(`verispec.divergence`, the same `VerdictLaw` the sampler draws from; tests check the two agree by "
          "chi-square).", "",
          "| rule | TV (T=1) | KL (T=1) | TV (T=0.7) | KL (T=0.7) |", "|---|---|---|---|---|"]
    for a, b in zip(tiny[1.0], tiny[0.7]):
        md.append(f"| {a['rule']} | {a['tv']:.2e} | {a['kl']:.2e} | {b['tv']:.2e} | {b['kl']:.2e} |")

    md += ["", "## 2. Real models: speed bought, quality paid", "",
           "Medians over prompts of the speedup over plain decoding measured in the same run; acceptance pooled; "
           "Δ log p = the target's mean log-probability of the sampled tokens minus plain sampling's on the same "
           "prompts (± 2 standard errors; exact rules should include 0); greedy = outputs identical to plain "
           "greedy; chrF on Spec-Bench translation (plain's in brackets); HumanEval problems whose completion "
           "passes its tests (executed, sandboxed) and math questions (Spec-Bench math_reasoning, MT-Bench math) "
           "whose final number is right, greedy / T=0.7, with plain decoding's on the same prompts."]
    for name, meta, records in runs:
        rules = ["exact"] + sorted({r["acceptance"] for r in records if r["acceptance"] != "exact"},
                                   key=lambda s: (s.split(":")[0], parameter(s)))
        first = next(r for r in records if r["k"])
        weights = meta["config"]["dtype"] + "".join(f", {q}" for q in meta["config"].get("quantize", []) if q)
        md += ["", f"### {first['pair']} (K = {first['k']}, {weights}; `{name}`)", "",
               "| rule | exact | greedy speedup | greedy acceptance | identical to plain greedy | T=0.7 speedup | "
               "T=0.7 acceptance | Δ log p (T=0.7) | chrF (T=0.7) | HumanEval pass@1 greedy / T=0.7 | "
               "math answers correct greedy / T=0.7 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for rule in rules:
            g, s = pooled(records, rule, "greedy"), pooled(records, rule, "sampled")
            if not g and not s:
                continue
            identical = "–" if g is None else f"{g['identical']}/{g['runs']}"
            delta = "–" if s is None else f"{s['logprob_delta']:+.3f} ± {2 * s['logprob_delta_se']:.3f}"
            metric = "–" if s is None or s["metric_value"] is None else \
                f"{s['metric_value']:.1f} ({s['plain_metric_value']:.1f})"
            md.append(f"| {rule} | {'yes' if parse_rule(rule).exact else '**no**'} | "
                      f"{fmt(g, 'speedup_median', '{:.2f}')} | {fmt(g, 'acceptance_rate', '{:.0%}')} | {identical} | "
                      f"{fmt(s, 'speedup_median', '{:.2f}')} | {fmt(s, 'acceptance_rate', '{:.0%}')} | {delta} | "
                      f"{metric} | {task_score(g, s, 'pass')} | {task_score(g, s, 'accuracy')} |")

    for family, grid in GRIDS.items():
        fig, axes = plt.subplots(1, 4, figsize=(19, 3.8))
        xs = [parameter(r) for r in grid]
        for temperature, rows in tiny.items():
            by_rule = {row["rule"]: row for row in rows}
            labels = [parse_rule(r).label() for r in grid]
            axes[0].plot(xs, [by_rule[l]["tv"] for l in labels], marker="o", label=f"TV, T={temperature:g}")
            axes[0].plot(xs, [by_rule[l]["kl"] for l in labels], marker="s", linestyle=":", label=f"KL, T={temperature:g}")
        axes[0].set_title(f"{family}: exact divergence, tiny models")
        axes[0].axhline(0, color="grey", linewidth=1)
        for name, meta, records in runs:
            rules = sorted({r["acceptance"] for r in records if r["acceptance"].startswith(family)}, key=parameter)
            if not rules:
                continue
            first = next(r for r in records if r["k"])
            label = first["pair"] if len(first["pair"]) < 48 else first["pair"][:45] + "…"
            px = [parameter(r) for r in rules]
            for mode, style in (("greedy", "--"), ("sampled", "-")):
                exact = pooled(records, "exact", mode)
                points = [pooled(records, r, mode) for r in rules]
                if exact is None or None in points:  # this results file has no runs in this mode
                    continue
                line = axes[1].plot(px, [p["speedup_median"] for p in points], marker="o", linestyle=style,
                                    label=f"{label} ({mode})")[0]
                axes[1].axhline(exact["speedup_median"], color=line.get_color(), linestyle=":", linewidth=1)
                if mode == "sampled":
                    axes[2].errorbar(px, [p["logprob_delta"] for p in points], yerr=[2 * p["logprob_delta_se"] for p in points],
                                     marker="o", capsize=3, label=label, color=line.get_color())
                    axes[2].axhline(exact["logprob_delta"], color=line.get_color(), linestyle=":", linewidth=1)
                else:
                    axes[3].plot(px, [p["identical"] / p["runs"] for p in points], marker="o", label=label,
                                 color=line.get_color())
                    axes[3].axhline(exact["identical"] / exact["runs"], color=line.get_color(), linestyle=":", linewidth=1)
        axes[1].set_title("speedup over plain (dotted: exact rule)")
        axes[2].set_title("Δ mean target log p, T=0.7 (dotted: exact)")
        axes[2].axhline(0, color="grey", linewidth=1)
        axes[3].set_title("greedy outputs identical to plain (dotted: exact)")
        axes[3].set_ylim(-0.05, 1.05)
        for ax in axes:
            ax.set_xlabel(AXIS[family], fontsize=8)
            ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / f"lossiness_{family}.png", dpi=80)
        plt.close(fig)
        md += ["", f"![{family}](lossiness_{family}.png)"]
    (out / "lossiness.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / 'lossiness.md'}")


if __name__ == "__main__":
    main()
