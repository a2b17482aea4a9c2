"""A draft pass's matrix products in each weight format, side by side: every matrix of SmolLM2-135M's 30
layers (qkv 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536) and its 49152 x 576 head, random
weights (~270 MB in bf16: they stream from memory, as in a forward pass), over 1, 2 and 4 rows.

    python benchmarks/draft_products.py --threads 2 --repeats 9

Prints the median ms of one sweep over all 121 products for: verispec's packed int4 kernel on each of
this CPU's int4 paths, the int8 runtime (``Int8Linear`` on the int8 paths chosen at run time), and the
bf16 few-row kernel (the bf16 target's own products). The formats alternate within each repeat, so a
shared machine's slow moments fall on all of them alike.
"""

from __future__ import annotations

import argparse

import torch

from verispec import kernels
from verispec.machine import cpu_name

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS, HEAD = 30, (49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = kernels._load()
    if module is None:
        raise SystemExit("verispec's kernels are not available here")
    torch.manual_seed(0)
    weights = [torch.randn(o, i) for _ in range(LAYERS) for o, i in SHAPES] + [torch.randn(*HEAD)]
    int4 = [kernels.PackedInt4Linear.from_float(w) for w in weights]
    int8 = [(kernels.Int8Linear.from_float(w), w.shape[1]) for w in weights]
    bf16 = [w.bfloat16() for w in weights]
    del weights
    chosen = kernels.int4_path()
    print(f"CPU: {cpu_name()}, {args.threads} threads, torch {torch.__version__}; int4 paths "
          f"{', '.join(module.int4_paths())} (chosen: {chosen}); int8 paths {', '.join(kernels.int8_paths())}")
    print("| rows | " + " | ".join([f"int4 {p}" for p in module.int4_paths()] + ["int8", "bf16"]) + " |")
    print("|---" * (len(module.int4_paths()) + 3) + "|")
    for rows in (1, 2, 4):
        x = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}

        def int4_sweep(path: str):
            def run() -> None:
                module.set_int4_path(path)
                for layer in int4:
                    layer(x[layer.in_features])
            return run

        fns = {f"int4 {p}": int4_sweep(p) for p in module.int4_paths()}
        fns["int8"] = lambda: [layer(x[inner]) for layer, inner in int8]
        fns["bf16"] = lambda: [kernels.linear(x[w.shape[1]], w) for w in bf16]
        timings = kernels.interleaved_medians(fns, args.repeats)
        print(f"| {rows} | " + " | ".join(f"{t * 1e3:.2f} ms" for t in timings.values()) + " |")
    module.set_int4_path(chosen)


if __name__ == "__main__":
    main()
