"""What int8 costs in quality against bf16, on reference text from the shared data.

    python benchmarks/quantization_quality.py --models smollm2-135m qwen2.5-coder-1.5b --texts 24 --greedy 4

For each model: the mean negative log-likelihood per token (and perplexity) of reference text —
HumanEval prompts with their canonical solutions, Spec-Bench questions with their references where
they have one — scored by the bf16 model and by the int8 model; and greedy agreement: on
``--greedy`` prompts (half HumanEval, half Spec-Bench), 128 greedy tokens from each, how many are
identical and where they first differ. Not a goal to tune: a fact users need.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from verispec import generate, load_model
from verispec.bench.metrics import first_divergence
from verispec.bench.runner import cpu_name
from verispec.bench.workloads import HUMANEVAL_FILES, SPEC_BENCH_FILE, _first_text, _read_jsonl, find_data_file

FORMATS = {"bf16": dict(dtype="bfloat16"), "int8": dict(dtype="bfloat16", quantize="int8")}


def reference_texts(n: int) -> list[str]:
    code = _read_jsonl(find_data_file(HUMANEVAL_FILES, None, "HumanEval"))
    prose = _read_jsonl(find_data_file((SPEC_BENCH_FILE,), None, "Spec-Bench"))
    texts = [r["prompt"] + r["canonical_solution"] for r in code[: n // 2]]
    step = max(1, len(prose) // (n - len(texts)))
    for row in prose[::step][: n - len(texts)]:
        question, reference = _first_text(row.get("turns")), _first_text(row.get("reference"))
        texts.append(question + ("\n\n" + reference if reference else ""))
    return texts


def mean_nll(model, ids: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of tokens 1.. given their prefixes, and how many tokens."""
    tokens = torch.tensor(ids)
    logits = model.forward(tokens, model.new_cache(len(ids)), 0)  # [T, vocab]
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    return float(-logprobs.gather(1, tokens[1:, None]).sum()), len(ids) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-1.5b"])
    parser.add_argument("--texts", type=int, default=24)
    parser.add_argument("--greedy", type=int, default=4, help="Prompts for greedy agreement (128 tokens each).")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--max-text-tokens", type=int, default=384, help="Reference texts are cut to this many tokens.")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    texts = reference_texts(args.texts)
    print(f"CPU: {cpu_name()}, {args.threads} threads; {len(texts)} reference texts, greedy agreement on "
          f"{args.greedy} prompts x {args.tokens} tokens")
    print("| model | bf16 NLL/token (ppl) | int8 NLL/token (ppl) | Δ NLL | greedy: identical / prompts | "
          "first divergence (median token) |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        scores, outputs = {}, {}
        for fmt, kwargs in FORMATS.items():
            model = load_model(name, **kwargs)
            tok = model.tokenizer
            total, count = 0.0, 0
            for text in texts:
                ids = tok(text)["input_ids"][: args.max_text_tokens]
                nll, n = mean_nll(model, ids)
                total, count = total + nll, count + n
            scores[fmt] = total / count
            prompts = texts[: args.greedy // 2] + texts[len(texts) // 2: len(texts) // 2 + args.greedy - args.greedy // 2]
            outputs[fmt] = [generate(model, input_ids=tok(p)["input_ids"][:256], max_new_tokens=args.tokens,
                                     ignore_eos=True).token_ids for p in prompts]
            del model
        same = sum(a == b for a, b in zip(outputs["bf16"], outputs["int8"]))
        divergences = [first_divergence(a, b) for a, b in zip(outputs["bf16"], outputs["int8"])]
        divergences = [d for d in divergences if d is not None]
        median = f"{statistics.median(divergences):.0f}" if divergences else "none"
        print(f"| {name} | {scores['bf16']:.4f} ({math.exp(scores['bf16']):.2f}) | {scores['int8']:.4f} "
              f"({math.exp(scores['int8']):.2f}) | {scores['int8'] - scores['bf16']:+.4f} | {same} / {len(divergences) + same} | "
              f"{median} |", flush=True)


if __name__ == "__main__":
    main()
