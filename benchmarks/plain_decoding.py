"""Plain greedy decoding: verispec's native runtime vs transformers' generate, side by side.

    python benchmarks/plain_decoding.py --models smollm2-135m qwen2.5-coder-1.5b --max-new-tokens 128

Both engines run the same converted weights, dtype, thread count and prompts, interleaved prompt by
prompt after a warm-up, so the printed ratio (median of per-prompt ratios) is measured side by side.
The roofline column is (weight bytes read per token x tokens/s) / measured read bandwidth.
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

PROMPTS = [
    "def quicksort(arr):",
    "Once upon a time, in a small village by the sea,",
    "The three most important ideas in thermodynamics are",
    "import numpy as np\n\ndef moving_average(x, window):",
]


def bench_model(name: str, dtype: str, max_new_tokens: int, prompts: list[str]) -> dict:
    native = verispec.load_model(name, dtype=dtype)
    reference = common.hf_reference(name, native.dtype)
    ids = [native.tokenizer.encode(p) for p in prompts]
    verispec.generate(native, input_ids=ids[0], max_new_tokens=8, ignore_eos=True)  # warm-up
    common.hf_greedy(reference, ids[0], 8)
    rows = []
    for prompt_ids in ids:
        ours = verispec.generate(native, input_ids=prompt_ids, max_new_tokens=max_new_tokens, ignore_eos=True)
        theirs, seconds = common.hf_greedy(reference, prompt_ids, max_new_tokens)
        rows.append({"native_tps": ours.stats.tokens_per_second, "hf_tps": max_new_tokens / seconds,
                     "same_output": ours.token_ids == theirs})
        print(f"  {name}: native {rows[-1]['native_tps']:.1f} tok/s, transformers {rows[-1]['hf_tps']:.1f} tok/s",
              file=sys.stderr, flush=True)
    return {"model": name, "dtype": dtype, "weight_bytes_per_token": common.weight_bytes_per_token(native),
            "prompts": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-1.5b"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/plain_decoding.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = common.read_bandwidth_gbs()
    results = {"machine": common.machine(), "read_bandwidth_gbs": bandwidth, "max_new_tokens": args.max_new_tokens,
               "models": [bench_model(m, args.dtype, args.max_new_tokens, PROMPTS[: args.prompts])
                          for m in args.models]}
    table = []
    for r in results["models"]:
        native = common.median([p["native_tps"] for p in r["prompts"]])
        hf = common.median([p["hf_tps"] for p in r["prompts"]])
        ratio = common.median([p["native_tps"] / p["hf_tps"] for p in r["prompts"]])
        gb = r["weight_bytes_per_token"] / 1e9
        table.append([r["model"], r["dtype"], native, hf, ratio, gb, native * gb / bandwidth, hf * gb / bandwidth,
                      f"{sum(p['same_output'] for p in r['prompts'])}/{len(r['prompts'])}"])
    print(f"machine: {results['machine']}; read bandwidth {bandwidth:.1f} GB/s; {args.threads} threads; "
          f"{args.max_new_tokens} new tokens, greedy")
    print(common.markdown_table(["model", "dtype", "native tok/s", "transformers tok/s", "ratio (median)",
                                 "GB read/token", "native roofline", "transformers roofline",
                                 "identical output"], table))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
