"""Helpers shared by the benchmark scripts: machine facts, prompts, reference models, tables."""

from __future__ import annotations

import gzip
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import verispec
from verispec.models.loading import resolve_source

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def machine() -> dict[str, Any]:
    from verispec.bench.runner import hardware, versions

    return {**hardware(), **versions()}


def read_bandwidth_gbs(megabytes: int = 1024, repeats: int = 5) -> float:
    """Best-of-n streaming read bandwidth: sum a large fp32 tensor (each byte read once)."""
    data = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def weight_bytes_per_token(model: Any) -> int:
    """Bytes of weights one decode step reads: every matrix once; of the embedding table, one row."""
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed" not in n)
    head = model.lm_head.weight
    if head is model.embed.weight:  # tied: the head reads the whole table
        total += head.numel() * head.element_size()
    return total


def hf_reference(name: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(resolve_source(name)), dtype=dtype).eval()


def hf_greedy(model: Any, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """transformers' own generate, fixed length (EOS ignored), greedy: (new ids, seconds)."""
    input_ids = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, attention_mask=torch.ones_like(input_ids))
    return out[0, len(ids):].tolist(), time.perf_counter() - start


def humaneval_prompts(n: int) -> list[dict[str, str]]:
    path = SHARED_DATA / "humaneval" / "HumanEval.jsonl.gz"
    if not path.exists():
        raise SystemExit(f"missing {path}: the HumanEval prompts live in ../shared/data")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    return [{"id": r["task_id"], "prompt": r["prompt"], "workload": "humaneval"} for r in rows[:n]]


def spec_bench_prompts(n_per_category: int, categories: tuple[str, ...] = ("mt_bench", "translation",
                       "summarization", "qa", "math_reasoning", "rag")) -> list[dict[str, str]]:
    path = SHARED_DATA / "spec_bench" / "question.jsonl"
    if not path.exists():
        raise SystemExit(f"missing {path}: the Spec-Bench prompts live in ../shared/data")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    mt_bench = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    picked: dict[str, list] = {c: [] for c in categories}
    for r in rows:
        category = "mt_bench" if r["category"] in mt_bench else r["category"]
        if category in picked and len(picked[category]) < n_per_category:
            picked[category].append({"id": str(r["question_id"]), "prompt": r["turns"][0],
                                     "workload": f"spec_bench/{category}"})
    return [p for c in categories for p in picked[c]]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
