"""Evaluation prompts: Spec-Bench by category, HumanEval, or any JSONL file with a "prompt" field."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from pathlib import Path
from typing import Any

from verispec.bench.answers import MT_BENCH_MATH, reference_answer
from verispec.errors import VerispecError

SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
METRIC_OF = {"translation": "chrf", "summarization": "rouge_l"}  # task metric per Spec-Bench category
SPEC_BENCH_FILE = Path("spec_bench") / "question.jsonl"
HUMANEVAL_FILES = (Path("humaneval") / "HumanEval.jsonl.gz", Path("humaneval") / "HumanEval.jsonl")


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    workload: str  # "humaneval", "spec_bench/translation", or a JSONL file's stem
    text: str
    reference: str | None = None  # for a task metric
    metric: str | None = None  # "chrf" or "rouge_l" when there is a reference
    completion: bool = False  # code completion: never wrapped in a chat template
    tests: tuple[str, str] | None = None  # HumanEval: (its test code, the entry point) to execute
    answer: str | None = None  # math: the reference's final number (verispec.bench.answers)


def data_dir_candidates(explicit: str | Path | None) -> list[Path]:
    if explicit is not None:
        return [Path(explicit).expanduser()]
    found = [Path(os.environ["VERISPEC_DATA_DIR"]).expanduser()] if os.environ.get("VERISPEC_DATA_DIR") else []
    source_checkout = Path(__file__).resolve().parents[3].parent / "shared" / "data"
    return found + [Path("data"), Path("..") / "shared" / "data", source_checkout]


def find_data_file(relative: tuple[Path, ...], data_dir: str | Path | None, what: str) -> Path:
    tried = []
    for folder in data_dir_candidates(data_dir):
        for rel in relative:
            path = folder / rel
            if path.is_file():
                return path
            tried.append(str(path))
    raise VerispecError(f"the {what} prompts are missing: looked for {', '.join(tried)}. "
                        "Pass --data-dir (or data_dir in the config) pointing at a folder that holds "
                        f"{relative[0]}, or set $VERISPEC_DATA_DIR")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise ValueError(f"line {number} is not a JSON object")
                    rows.append(row)
    except (OSError, ValueError) as exc:
        raise VerispecError(f"cannot read {path}: {exc}") from None
    return rows


def _first_text(value: Any) -> str | None:
    """Spec-Bench stores turns and references as lists; take the first string."""
    while isinstance(value, list) and value:
        value = value[0]
    return value if isinstance(value, str) else None


def spec_bench(n: int, category: str | None, data_dir: str | Path | None) -> list[Prompt]:
    if category is not None and category not in SPEC_BENCH_CATEGORIES:
        raise VerispecError(f"unknown Spec-Bench category '{category}'; choose from {', '.join(SPEC_BENCH_CATEGORIES)}")
    rows = _read_jsonl(find_data_file((SPEC_BENCH_FILE,), data_dir, "Spec-Bench"))
    categories = [category] if category else list(SPEC_BENCH_CATEGORIES)
    picked: dict[str, list[Prompt]] = {c: [] for c in categories}
    for row in rows:
        name = "mt_bench" if row.get("category") in MT_BENCH else row.get("category")
        text = _first_text(row.get("turns"))
        if name in picked and text and len(picked[name]) < n:
            reference = _first_text(row.get("reference")) if name in METRIC_OF else None
            picked[name].append(Prompt(str(row.get("question_id")), f"spec_bench/{name}", text, reference,
                                       METRIC_OF.get(name) if reference else None, answer=_answer(row)))
    return [p for c in categories for p in picked[c]]


def _answer(row: dict[str, Any]) -> str | None:
    """The expected final number of a math question (GSM8K's ``#### N``; MT-Bench math: read by hand)."""
    if row.get("category") == "math_reasoning":
        return reference_answer(_first_text(row.get("reference")))
    if row.get("category") == "math":
        return MT_BENCH_MATH.get(str(row.get("question_id")))
    return None


def humaneval(n: int, data_dir: str | Path | None) -> list[Prompt]:
    rows = _read_jsonl(find_data_file(HUMANEVAL_FILES, data_dir, "HumanEval"))
    return [Prompt(str(r["task_id"]), "humaneval", r["prompt"], completion=True,
                   tests=(r["test"], r["entry_point"]) if "test" in r and "entry_point" in r else None)
            for r in rows[:n] if "prompt" in r]


def user_jsonl(path: Path, n: int) -> list[Prompt]:
    if not path.is_file():
        raise VerispecError(f"workload file {path} does not exist")
    prompts = []
    for i, row in enumerate(_read_jsonl(path)[:n]):
        text = row.get("prompt")
        if not isinstance(text, str) or not text:
            raise VerispecError(f"{path}: line {i + 1} has no non-empty string field 'prompt'")
        reference = row.get("reference") if isinstance(row.get("reference"), str) else None
        metric = row.get("metric", "rouge_l") if reference else None
        if metric not in (None, "chrf", "rouge_l"):
            raise VerispecError(f"{path}: line {i + 1}: metric must be 'chrf' or 'rouge_l', got {metric!r}")
        prompts.append(Prompt(str(row.get("id", i)), path.stem, text, reference, metric, bool(row.get("completion", False))))
    return prompts


def load_workload(name: str, n: int, data_dir: str | Path | None = None) -> list[Prompt]:
    """``humaneval``, ``spec_bench`` (every category), ``spec_bench/<category>``, or a .jsonl path."""
    if name == "humaneval":
        return humaneval(n, data_dir)
    if name == "spec_bench":
        return spec_bench(n, None, data_dir)
    if name.startswith("spec_bench/"):
        return spec_bench(n, name.split("/", 1)[1], data_dir)
    if name.endswith((".jsonl", ".jsonl.gz")):
        return user_jsonl(Path(name).expanduser(), n)
    raise VerispecError(f"unknown workload '{name}': use humaneval, spec_bench, spec_bench/<category> "
                        f"({', '.join(SPEC_BENCH_CATEGORIES)}) or a .jsonl file with a 'prompt' field")
