"""A prompt's attention on AMX bf16 tiles (bf16x3) against torch's fp32 attention: accuracy, speed, quality.

    python benchmarks/prompt_attention.py --models smollm2-135m qwen2.5-coder-1.5b --texts 24

1. Accuracy: the largest error against an fp64 reference, for the tile kernel, torch's fp32
   scaled_dot_product_attention and the same in bf16, on random inputs of each model's attention shape.
2. Speed: one layer's prompt attention (``--rows`` rows), the two taking turns ``--repeats`` times.
3. Quality, on reference text from the shared data (as quantization_quality.py), for each of
   ``--formats``: mean negative log-likelihood per token with the prompt's attention in fp64 (the
   reference), torch's fp32 and the tiles, and greedy agreement with the fp64 run over ``--tokens``
   tokens on ``--greedy`` prompts (the prompt's attention is all that differs). In int8, per-row
   activation rounding turns any change, fp32's own rounding included, into different tokens within a
   few dozen; bf16 weights show the attention's own effect.

``VERISPEC_TILE_ATTENTION=0`` is how the comparison switches the tile kernel off (read on every call).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from quantization_quality import mean_nll, reference_texts  # noqa: E402

from verispec import generate, load_model  # noqa: E402
from verispec import kernels  # noqa: E402
from verispec.bench.metrics import first_divergence  # noqa: E402
from verispec.bench.runner import cpu_name  # noqa: E402


def torch_attention(q, keys, values, start, dtype=torch.float32):
    """kernels.causal_attention's torch path for a prompt, in ``dtype``."""
    H, T, D = q.shape
    mask = torch.ones(T, start + T, dtype=torch.bool).tril(start)
    out = F.scaled_dot_product_attention(q[None].to(dtype), keys[None].to(dtype), values[None].to(dtype),
                                         attn_mask=mask, scale=1.0, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(T, H * D)


def accuracy_and_speed(name: str, config, rows: int, repeats: int, module) -> None:
    """Errors against fp64 on random inputs of the model's attention shape, and one layer's time."""
    H, KV, D = config.num_heads, config.num_kv_heads, config.head_dim
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(H, rows, D, generator=gen) * D ** -0.5 * 3
    keys, values = torch.randn(KV, rows, D, generator=gen), torch.randn(KV, rows, D, generator=gen)
    exact = torch_attention(q.double(), keys.double(), values.double(), 0, torch.float64)
    errors = {"tiles (bf16x3)": module.prompt_attention(q, keys, values, 0), "torch fp32": torch_attention(q, keys, values, 0),
              "torch bf16": torch_attention(q, keys, values, 0, torch.bfloat16)}
    print(f"\n{name}: {H} heads / {KV} KV heads of {D}, {rows} rows; largest error against fp64: "
          + ", ".join(f"{k} {(v.double() - exact).abs().max().item():.2e}" for k, v in errors.items()))
    fns = {"tiles": lambda: module.prompt_attention(q, keys, values, 0),
           "torch fp32": lambda: F.scaled_dot_product_attention(q[None], keys[None], values[None], is_causal=True,
                                                                scale=1.0, enable_gqa=True)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for turn in range(repeats + 1):
        for k, fn in fns.items():
            begin = time.perf_counter()
            fn()
            if turn:
                times[k].append(time.perf_counter() - begin)
    ratio = statistics.median(a / b for a, b in zip(times["torch fp32"], times["tiles"]))
    print(f"one layer's attention: tiles {statistics.median(times['tiles']) * 1e3:.2f} ms, torch fp32 "
          f"{statistics.median(times['torch fp32']) * 1e3:.2f} ms (median of {repeats}, taking turns): "
          f"tiles {ratio:.2f}x faster")


def fp64_attention(q, keys, values, start):
    """kernels.causal_attention with a prompt's attention in fp64 (the reference both kernels are judged by)."""
    if q.shape[1] <= kernels.INVARIANT_ROWS:
        return FP32_ATTENTION(q, keys, values, start)
    return torch_attention(q.double(), keys.double(), values.double(), start, torch.float64).float()


FP32_ATTENTION = kernels.causal_attention
KINDS = {"fp64": dict(VERISPEC_FUSED_LAYERS="0"), "torch fp32": dict(VERISPEC_TILE_ATTENTION="0"),
         "tiles": dict(VERISPEC_TILE_ATTENTION="1")}


def quality(name: str, model, texts: list[str], max_tokens: int, greedy: int, tokens: int) -> list[str]:
    """Table rows: NLL/token of reference text and greedy agreement with the fp64 attention, per kind."""
    tok = model.tokenizer
    prompts = texts[: greedy // 2] + texts[len(texts) // 2: len(texts) // 2 + greedy - greedy // 2]
    scores, outputs = {}, {}
    for kind, switches in KINDS.items():
        os.environ.update(switches)
        kernels.causal_attention = fp64_attention if kind == "fp64" else FP32_ATTENTION
        try:
            total, count = 0.0, 0
            for text in texts:
                nll, n = mean_nll(model, tok(text)["input_ids"][:max_tokens])
                total, count = total + nll, count + n
            scores[kind] = total / count
            outputs[kind] = [generate(model, input_ids=tok(p)["input_ids"][:256], max_new_tokens=tokens,
                                      ignore_eos=True).token_ids for p in prompts]
        finally:
            kernels.causal_attention = FP32_ATTENTION
            for switch in switches:
                os.environ.pop(switch)
    rows = []
    for kind in ("torch fp32", "tiles"):
        same = sum(a == b for a, b in zip(outputs[kind], outputs["fp64"]))
        divergences = [first_divergence(a, b) for a, b in zip(outputs[kind], outputs["fp64"])]
        rows.append(f"| {name} | {kind} | {scores[kind]:.5f} | {scores[kind] - scores['fp64']:+.5f} | {same} / {len(prompts)} "
                    f"| {', '.join('-' if d is None else str(d) for d in divergences)} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-1.5b"])
    parser.add_argument("--rows", type=int, default=703)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--texts", type=int, default=24)
    parser.add_argument("--max-text-tokens", type=int, default=384)
    parser.add_argument("--greedy", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--formats", nargs="+", default=["int8", "bf16"], choices=["int8", "bf16"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = kernels._load()
    if module is None or not module.prompt_attention_supported(64):
        sys.exit("this CPU (or build) has no AMX-BF16 tiles: prompts' attention runs on torch's fp32 kernel here")
    print(f"CPU: {cpu_name()}, {args.threads} threads")
    texts = reference_texts(args.texts)
    rows = []
    for name in args.models:
        for quantize in args.formats:
            model = load_model(name, dtype="bfloat16", quantize=None if quantize == "bf16" else quantize)
            if quantize == args.formats[0]:
                accuracy_and_speed(name, model.config, args.rows, args.repeats, module)
            rows += [row.replace(f"| {name} |", f"| {name} {quantize} |", 1)
                     for row in quality(name, model, texts, args.max_text_tokens, args.greedy, args.tokens)]
            del model
    print(f"\nQuality: {len(texts)} reference texts (up to {args.max_text_tokens} tokens), greedy agreement on "
          f"{args.greedy} prompts x {args.tokens} tokens")
    print("| model | prompt attention | NLL/token | Δ NLL vs fp64 attention | greedy identical to fp64's | "
          "first divergence per prompt (token) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))

if __name__ == "__main__":
    main()
