"""The matrix products of one decode step, every kernel alternative side by side (issue 12's table).

    python benchmarks/int8_kernels.py --threads 2 --out results/int8-kernels.md

Shapes: Qwen2.5-Coder-1.5B (28 layers of fused qkv 2048x1536, o 1536x1536, fused gate/up 17920x1536,
down 1536x8960, and the 151936x1536 LM head), random weights (speed does not depend on the values).
For each kernel: milliseconds for all of them over M = 1 row (a decode step) and the cost of
M = 4, 8, 16 rows relative to one, the share of the read bandwidth one row reaches, and whether a
row's result is bit-identical whatever other rows share the call (checked with an outlier row).
Every alternative is measured in this one run, on this machine; say which CPU the numbers are from.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from verispec import kernels  # noqa: E402
from verispec.bench.runner import cpu_name, read_bandwidth_gbs  # noqa: E402

LAYER_SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]
HEAD = (151936, 1536)
ROWS = (1, 4, 8, 16)

Linear = Callable[[torch.Tensor], torch.Tensor]


def shapes(layers: int) -> list[tuple[int, int]]:
    return LAYER_SHAPES * layers + [HEAD]


def random_weight(out: int, inner: int) -> torch.Tensor:
    base = torch.randn(1 << 20) * 0.02
    return base.repeat(-(-out * inner // base.numel()))[: out * inner].view(out, inner)


def builders() -> dict[str, Callable[[torch.Tensor], Linear | None]]:
    def bf16_kernel(w):
        wb = w.bfloat16().contiguous()
        return (lambda x: kernels.linear(x, wb)) if kernels.available() else None

    def torch_bf16(w):
        wb = w.bfloat16()
        return lambda x: F.linear(x.bfloat16(), wb)

    def torch_fp32(w):
        wf = w.clone()
        return lambda x: F.linear(x, wf)

    def fbgemm_dynamic(w):
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w
        q = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear}, dtype=torch.qint8)
        return q[0]

    def int8_path(path):
        def build(w):
            if path not in kernels.int8_paths():
                return None
            q = kernels.Int8Linear.from_float(w)
            weight = kernels.pack_vnni(q.rows()) if kernels.weight_layout(path) == "packed" else q.rows()
            module = kernels._load()
            return lambda x: module.int8_linear(x, weight, q.scale, q.row_sums, None, path)
        return build

    def int4(w):
        q = kernels.Int4Linear.from_float(w)
        return q

    return {"verispec bf16 kernel (AVX2 FMA)": bf16_kernel, "torch bf16 F.linear": torch_bf16,
            "torch fp32 F.linear": torch_fp32, "torch.ao dynamic int8 (fbgemm, per-tensor activations)": fbgemm_dynamic,
            "verispec int8: torch._int_mm, per-row activations": int8_path("intmm"),
            "verispec int8: AMX tiles, packed weights": int8_path("amx"),
            "verispec int8: AVX-512 VNNI kernel, packed weights": int8_path("vnni"),
            "verispec int8: AVX-512 VNNI kernel, weights as rows": int8_path("vnni-rows"),
            "verispec int8: AVX2 kernel": int8_path("avx2"),
            "aten int4 pack mm, group 128 (bf16 activations)": int4}


def invariant(linear: Linear, inner: int) -> bool:
    x = torch.randn(8, inner)
    x[-1] *= 40  # an outlier token
    together = linear(x).float()
    return all(torch.equal(together[i:i + 1], linear(x[i:i + 1]).float()) for i in range(8))


def measure(name: str, build: Callable[[torch.Tensor], Linear | None], layers: int, repeats: int) -> dict | None:
    linears = []
    for out, inner in shapes(layers):
        linear = build(random_weight(out, inner))
        if linear is None:
            return None
        linears.append((linear, inner))
    result = {"name": name, "ms": {}, "bytes": None}
    with torch.inference_mode():
        result["invariant"] = invariant(*linears[0])
        for m in ROWS:
            inputs = {inner: torch.randn(m, inner) for _, inner in linears}
            for linear, inner in linears[:4]:
                linear(inputs[inner])  # warm-up
            runs = []
            for _ in range(repeats):
                begin = time.perf_counter()
                for linear, inner in linears:
                    linear(inputs[inner])
                runs.append(time.perf_counter() - begin)
            result["ms"][m] = statistics.median(runs) * 1e3
    return result


def weight_bytes(name: str, layers: int) -> float:
    per = 1.0 if "int8" in name else 0.5 if "int4" in name else 4.0 if "fp32" in name else 2.0
    return sum(o * i for o, i in shapes(layers)) * per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="Also write the table (markdown) here.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth_gbs()
    lines = [f"CPU: {cpu_name()} (torch capability {torch.backends.cpu.get_cpu_capability()}), {args.threads} threads, "
             f"torch {torch.__version__}; measured read bandwidth {bandwidth:.1f} GB/s; int8 paths here: "
             f"{', '.join(kernels.int8_paths())}", "",
             "| kernel | 1 row: ms (tok/s ceiling) | share of read bandwidth | M=4 | M=8 | M=16 | rows bit-identical whatever M |",
             "|---|---|---|---|---|---|---|"]
    for name, build in builders().items():
        r = measure(name, build, args.layers, args.repeats)
        if r is None:
            lines.append(f"| {name} | not available on this machine | | | | | |")
            continue
        one = r["ms"][1]
        share = weight_bytes(name, args.layers) / (one / 1e3) / (bandwidth * 1e9)
        lines.append(f"| {name} | {one:.1f} ({1e3 / one:.1f}) | {share:.0%} | " +
                     " | ".join(f"{r['ms'][m] / one:.2f}x" for m in ROWS[1:]) +
                     f" | {'**yes**' if r['invariant'] else 'no'} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
