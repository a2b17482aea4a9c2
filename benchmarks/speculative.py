"""Speculative decoding with a draft model vs plain decoding of the same target, side by side.

    python benchmarks/speculative.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b -k 5 \
        --humaneval 4 --spec-bench 1 --max-new-tokens 128 --fp32-check 2

For every prompt and decoding mode, plain and speculative runs alternate after a warm-up, so each
speedup is a ratio measured side by side; the table reports the median of per-prompt ratios.
Greedy outputs are compared token by token with plain greedy (bf16 batched verification is not
bit-identical to one-token steps, so the fp32 check repeats a few prompts in float32).
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

MODES = {"greedy": verispec.SamplingConfig(), "T=0.7": verispec.SamplingConfig(temperature=0.7)}


def run_pair(target, drafter, prompt: dict, sampling, max_new_tokens: int, seed: int) -> dict:
    sampling = verispec.SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
    chat = prompt["workload"] != "humaneval"  # HumanEval is code completion; Spec-Bench prompts are chats
    kwargs = dict(max_new_tokens=max_new_tokens, sampling=sampling, chat=chat)
    plain = verispec.generate(target, prompt["prompt"], **kwargs)
    spec = verispec.generate(target, prompt["prompt"], drafter=drafter, **kwargs)
    first_diff = next((i for i, (a, b) in enumerate(zip(plain.token_ids, spec.token_ids)) if a != b),
                      None if len(plain.token_ids) == len(spec.token_ids) else min(map(len, (plain.token_ids, spec.token_ids))))
    return {"id": prompt["id"], "workload": prompt["workload"], "plain": plain.stats.as_dict(),
            "spec": spec.stats.as_dict(), "identical": plain.token_ids == spec.token_ids, "first_diff": first_diff}


def decode_tps(stats: dict) -> float:
    """Decode throughput (after the prefill): sampled plain and speculative runs differ in length."""
    seconds = stats["wall_seconds"] - stats["prefill_seconds"]
    return (stats["new_tokens"] - 1) / seconds


def summarise(rows: list[dict]) -> list:
    plain_tps = [decode_tps(r["plain"]) for r in rows]
    spec_tps = [decode_tps(r["spec"]) for r in rows]
    drafted = sum(r["spec"]["drafted_tokens"] for r in rows)
    accepted = sum(r["spec"]["accepted_tokens"] for r in rows)
    steps = sum(r["spec"]["decode_steps"] for r in rows)
    step_tokens = sum(r["spec"]["decode_step_tokens"] for r in rows)
    return [common.median(plain_tps), common.median(spec_tps),
            common.median([s / p for s, p in zip(spec_tps, plain_tps)]),
            accepted / drafted if drafted else 0.0, step_tokens / steps if steps else 0.0,
            sum(r["plain"]["target_calls"] for r in rows) / len(rows),
            sum(r["spec"]["target_calls"] for r in rows) / len(rows),
            f"{sum(r['identical'] for r in rows)}/{len(rows)}"]


HEADER = ["workload", "mode", "prompts", "plain decode tok/s", "spec decode tok/s", "speedup (median)",
          "acceptance", "mean accepted length", "plain target calls", "spec target calls", "identical to plain"]


def table_of(rows: list[dict], modes: list[str]) -> list[list]:
    table = []
    for mode in modes:
        for workload in ("humaneval", "spec_bench"):
            group = [r for r in rows if r["mode"] == mode and r["workload"].startswith(workload)]
            if group:
                table.append([workload, mode, len(group)] + summarise(group))
    return table


def fp32_check(args, prompts: list[dict]) -> str:
    target = verispec.load_model(args.target, dtype="float32")
    drafter = verispec.DraftModel(verispec.load_model(args.draft, dtype="float32"), k=args.k)
    same = 0
    for p in prompts:
        row = run_pair(target, drafter, p, MODES["greedy"], args.fp32_tokens, 0)
        same += row["identical"]
        print(f"  fp32 {p['id']}: identical={row['identical']}", file=sys.stderr, flush=True)
    return f"{same}/{len(prompts)} prompts identical to plain greedy in float32 ({args.fp32_tokens} tokens)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--humaneval", type=int, default=4, help="HumanEval prompts")
    parser.add_argument("--spec-bench", type=int, default=1, help="Spec-Bench prompts per category")
    parser.add_argument("--spec-bench-categories", type=int, default=6, help="first N Spec-Bench categories")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--fp32-check", type=int, default=2, help="prompts re-run in float32 (0: skip)")
    parser.add_argument("--fp32-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/speculative.json")
    parser.add_argument("--report-only", default=None, help="re-print the table from a saved JSON file")
    args = parser.parse_args()
    if args.report_only:
        saved = json.loads(Path(args.report_only).read_text())
        print(common.markdown_table(HEADER, table_of(saved["rows"], saved["args"]["modes"])))
        print(f"fp32 greedy check: {saved['fp32_check']}")
        return
    torch.set_num_threads(args.threads)
    categories = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")[: args.spec_bench_categories]
    prompts = common.humaneval_prompts(args.humaneval) + common.spec_bench_prompts(args.spec_bench, categories)
    target = verispec.load_model(args.target, dtype=args.dtype)
    drafter = verispec.DraftModel(verispec.load_model(args.draft, dtype=args.dtype), k=args.k)
    run_pair(target, drafter, prompts[0], MODES["greedy"], 8, 0)  # warm-up
    rows = []
    for mode in args.modes:
        for i, p in enumerate(prompts):
            row = run_pair(target, drafter, p, MODES[mode], args.max_new_tokens, seed=i)
            row["mode"] = mode
            rows.append(row)
            print(f"  [{mode}] {p['workload']} {p['id']}: plain {row['plain']['tokens_per_second']:.2f} tok/s, "
                  f"spec {row['spec']['tokens_per_second']:.2f} tok/s, acceptance "
                  f"{row['spec']['acceptance_rate']:.0%}, identical={row['identical']}", file=sys.stderr, flush=True)
    table = table_of(rows, args.modes)
    header = HEADER
    print(f"machine: {common.machine()}; {args.draft} drafting for {args.target}, K={args.k}, {args.dtype}, "
          f"{args.max_new_tokens} new tokens")
    print(common.markdown_table(header, table))
    fp32 = fp32_check(args, prompts[: args.fp32_check]) if args.fp32_check else "skipped"
    print(f"fp32 greedy check: {fp32}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": common.machine(), "args": vars(args), "rows": rows,
                                          "table": table, "fp32_check": fp32}, indent=2))


if __name__ == "__main__":
    main()
