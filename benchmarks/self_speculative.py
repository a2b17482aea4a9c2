"""Self-speculative drafters (layer skip, early exit, low rank, prompt lookup) vs plain decoding.

    python benchmarks/self_speculative.py --model smollm2-135m --humaneval 3 --spec-bench-categories 3 \
        --k 2 4 --max-new-tokens 128

Layer skip and early exit use settings from `verispec tune` (``--layer-skip FILE`` /
``--early-exit FILE``), or are tuned at the start of the run. For every prompt, plain decoding runs
first and each drafter / K right after it, greedy, so every speedup is measured side by side; the
table gives medians of per-prompt ratios. Draft cost is the time of one draft pass over the time of
one plain decode step, measured in the same runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import verispec  # noqa: E402
from verispec.tuning import tune  # noqa: E402


def drafters_for(model, args) -> dict[str, callable]:
    progress = lambda m: print(f"  [tune] {m}", file=sys.stderr, flush=True)
    if args.layer_skip:
        skip = json.loads(Path(args.layer_skip).read_text())
    else:
        skip = tune("layer-skip", model, new_tokens=args.tune_tokens, progress=progress,
                    max_skipped=args.tune_skipped, prompts=verispec.tuning.CALIBRATION_PROMPTS[: args.tune_prompts])
    if args.early_exit:
        exit_ = json.loads(Path(args.early_exit).read_text())
    else:
        exit_ = tune("early-exit", model, new_tokens=args.tune_tokens, progress=progress,
                     prompts=verispec.tuning.CALIBRATION_PROMPTS[: args.tune_prompts])
    out = Path(args.out).with_suffix("")
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, spec in (("layer-skip", skip), ("early-exit", exit_)):
        Path(f"{out}-{name}.json").write_text(json.dumps(spec, indent=2))
    return {
        "layer-skip": lambda k: verispec.LayerSkip(skip["skip"], k=k, skip_attention=skip["skip_attention"],
                                                   skip_mlp=skip["skip_mlp"]),
        "early-exit": lambda k: verispec.EarlyExit(exit_["layer"], k=k),
        "low-rank": lambda k: verispec.LowRank(rank=args.low_rank, k=k),
        "prompt-lookup": lambda k: verispec.PromptLookup(ngram=3, k=k),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--methods", nargs="+", default=["layer-skip", "early-exit", "low-rank", "prompt-lookup"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--humaneval", type=int, default=3)
    parser.add_argument("--spec-bench-categories", type=int, default=3, help="first N Spec-Bench categories, 1 prompt each")
    parser.add_argument("--layer-skip", default=None, help="settings file from `verispec tune layer-skip`")
    parser.add_argument("--early-exit", default=None, help="settings file from `verispec tune early-exit`")
    parser.add_argument("--low-rank", type=int, default=128, help="rank of the low-rank draft")
    parser.add_argument("--tune-tokens", type=int, default=32)
    parser.add_argument("--tune-prompts", type=int, default=2)
    parser.add_argument("--tune-skipped", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/self_speculative.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = verispec.load_model(args.model, dtype=args.dtype)
    categories = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")[: args.spec_bench_categories]
    prompts = common.humaneval_prompts(args.humaneval) + common.spec_bench_prompts(1, categories)
    factories = drafters_for(model, args)
    verispec.generate(model, input_ids=[1, 2, 3], max_new_tokens=4)  # warm-up
    rows = []
    for p in prompts:
        chat = p["workload"] != "humaneval"
        plain = verispec.generate(model, p["prompt"], max_new_tokens=args.max_new_tokens, chat=chat)
        step_seconds = plain.stats.wall_seconds / plain.stats.target_calls
        for method in args.methods:
            for k in args.k:
                spec = verispec.generate(model, p["prompt"], max_new_tokens=args.max_new_tokens, chat=chat,
                                         drafter=factories[method](k))
                s = spec.stats
                rows.append({"workload": p["workload"], "id": p["id"], "method": method, "k": k,
                             "settings": s.settings, "speedup": s.tokens_per_second / plain.stats.tokens_per_second,
                             "acceptance": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
                             "draft_cost": (s.draft_seconds / s.draft_calls / step_seconds) if s.draft_calls else 0.0,
                             "identical": spec.token_ids == plain.token_ids, "plain": plain.stats.as_dict(),
                             "spec": s.as_dict()})
                print(f"  {p['workload']} {p['id']} {method} K={k}: speedup {rows[-1]['speedup']:.2f}x, acceptance "
                      f"{s.acceptance_rate:.0%}, identical={rows[-1]['identical']}", file=sys.stderr, flush=True)
    table = []
    for workload in ("humaneval", "spec_bench"):
        for method in args.methods:
            for k in args.k:
                group = [r for r in rows if r["workload"].startswith(workload) and r["method"] == method and r["k"] == k]
                if not group:
                    continue
                drafted = sum(r["spec"]["drafted_tokens"] for r in group)
                accepted = sum(r["spec"]["accepted_tokens"] for r in group)
                steps = sum(r["spec"]["decode_steps"] for r in group)
                step_tokens = sum(r["spec"]["decode_step_tokens"] for r in group)
                table.append([workload, method, k, len(group), accepted / drafted if drafted else 0.0,
                              step_tokens / steps, common.median([r["draft_cost"] for r in group]),
                              common.median([r["speedup"] for r in group]),
                              f"{sum(r['identical'] for r in group)}/{len(group)}"])
    print(f"machine: {common.machine()}; model {args.model}, {args.dtype}, greedy, {args.max_new_tokens} new tokens")
    print("settings: " + "; ".join(f"{m}: {factories[m](args.k[0]).settings()}" for m in args.methods
                                   if m in ("layer-skip", "early-exit")) + f"; low-rank: rank {args.low_rank}")
    print(common.markdown_table(["workload", "method", "K", "prompts", "acceptance", "mean accepted length",
                                 "draft cost / step", "speedup (median)", "identical to plain"], table))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": common.machine(), "args": vars(args), "rows": rows,
                                          "table": table}, indent=2))


if __name__ == "__main__":
    main()
