"""Bench records: built from a run's ``GenerationStats``, read back, summarised. No torch, no runtime.

A results file is JSON Lines: one ``{"type": "meta"}`` line (config, hardware, versions), then one
``{"type": "record"}`` line per (setting, prompt, decoding mode, repetition), written and flushed as
each run ends. A record carries every ``GenerationStats`` field and derived metric under its own
name, plus what the benchmark knows around it (workload, prompt, the comparison with plain
decoding on the same prompt, quality checks). Summaries are computed from records when a report is
rendered, never stored, so a partial file summarises too.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

from verispec.bench.execution import pass_at_k, wilson_interval
from verispec.bench.metrics import METRICS, first_divergence
from verispec.errors import VerispecError
from verispec.stats import GenerationStats

SCHEMA_VERSION = 2


class RunOutput(Protocol):
    """What a bench engine returns for one run (``verispec.GenerationResult`` is one)."""

    token_ids: list[int]
    text: str | None
    target_logprobs: list[float]
    stats: GenerationStats


def mode_label(temperature: float, top_k: int, top_p: float) -> str:
    """'greedy', or 'T=0.7 top_k=0 top_p=1' — one decoding mode's name in summaries and reports."""
    return "greedy" if temperature == 0 else f"T={temperature:g} top_k={top_k} top_p={top_p:g}"


def make_record(context: dict[str, Any], run: RunOutput, plain: RunOutput | None, greedy: bool,
                reference: str | None = None, metric: str | None = None,
                weight_bytes: int | None = None, bandwidth_gbs: float | None = None) -> dict[str, Any]:
    """One record: ``context`` (what ran, on what prompt, how), the run's stats, and its comparison
    with ``plain`` (the same prompt's plain run; None when ``run`` is that plain run)."""
    stats = run.stats.as_dict()
    base = plain or run
    plain_tps = base.stats.tokens_per_second
    score = METRICS[metric] if metric else None
    decode_rate = run.stats.decode_tokens_per_second
    plain_decode = base.stats.decode_tokens_per_second
    return {
        "type": "record", "schema": SCHEMA_VERSION, **context, **stats,
        "speedup": run.stats.tokens_per_second / plain_tps if plain_tps > 0 else None,
        # the plain run this one compares with (under interleaved timing, the one made beside it)
        "plain_tokens_per_second": plain_tps,
        # The same after the first token: the prefill is one target pass over the prompt, the same work in
        # both runs, and on a long prompt it is 10-25% of a 128-token run whose time swings 2x between
        # runs' prefills (0.52-0.92 s for one 671-token prompt, SmolLM2 bf16), more than the
        # differences between K. What speculation adds (a draft model's own prefill, k="auto"'s
        # calibration, drafting) is after the first token, so it counts here.
        "decode_speedup": decode_rate / plain_decode if decode_rate and plain_decode else None,
        "plain_decode_tokens_per_second": plain_decode,
        "identical_to_plain": (run.token_ids == base.token_ids) if greedy else None,
        "first_divergence": first_divergence(run.token_ids, base.token_ids) if greedy else None,
        # Every mode: sampled runs of a deterministic drafter under the exact rule commit plain sampling's
        # tokens for the seed (position-keyed sampling), so their ratios compare the same text.
        "same_tokens_as_plain": run.token_ids == base.token_ids,
        "target_logprob_mean": statistics.fmean(run.target_logprobs) if run.target_logprobs else None,
        "plain_target_logprob_mean": statistics.fmean(base.target_logprobs) if base.target_logprobs else None,
        "metric": metric,
        "metric_value": score(run.text or "", reference) if score else None,
        "plain_metric_value": score(base.text or "", reference) if score else None,
        "weight_bytes_per_token": weight_bytes,
        # Share of the machine's measured read bandwidth that reading the target's weights once per
        # decode step (plain) would use at this decode rate.
        "roofline": weight_bytes * decode_rate / (bandwidth_gbs * 1e9)
        if weight_bytes and decode_rate and bandwidth_gbs else None,
        "output_text": run.text or "", "output_ids": run.token_ids,
    }


def read_results(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(meta, records) of a results file."""
    path = Path(path)
    if not path.is_file():
        raise VerispecError(f"results file {path} does not exist")
    meta, records = None, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise VerispecError(f"{path}:{number} is not JSON: is this a `verispec bench` results file?") from None
        if row.get("type") == "meta":
            meta = row
        elif row.get("type") == "record":
            records.append(row)
    if meta is None:
        raise VerispecError(f"{path} has no meta line: is this a `verispec bench` results file?")
    if meta.get("schema") != SCHEMA_VERSION:
        raise VerispecError(f"{path} was written with results schema {meta.get('schema')}; this verispec reads "
                            f"schema {SCHEMA_VERSION}: re-run the benchmark")
    if not records:
        raise VerispecError(f"{path} holds no measured runs yet")
    return meta, records


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """Median and the 25th/75th percentiles (min/max for fewer than 4 values)."""
    values = sorted(values)
    if len(values) < 4:
        return statistics.median(values), values[0], values[-1]
    q = statistics.quantiles(values, n=4)
    return statistics.median(values), q[0], q[2]


def _mean(values: Iterable[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _median(values: Iterable[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _sum(rows: list[dict[str, Any]], key: str) -> int | None:
    """The total over rows, or None when any row could not observe it."""
    values = [r[key] for r in rows]
    return None if any(v is None for v in values) else sum(values)


def summarise(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per (setting, workload, mode). Pooled rates divide pooled counts (not means of
    per-run rates), under the same definitions as ``GenerationStats``."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["setting"], r["workload"], r["mode"]), []).append(r)
    return [_summary(rows) for rows in groups.values()]


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    first = rows[0]
    pooled = GenerationStats(
        new_tokens=sum(r["new_tokens"] for r in rows), target_calls=sum(r["target_calls"] for r in rows),
        drafted_tokens=_sum(rows, "drafted_tokens"), accepted_tokens=_sum(rows, "accepted_tokens"),
        decode_steps=sum(r["decode_steps"] for r in rows), decode_step_tokens=sum(r["decode_step_tokens"] for r in rows))
    speedups = [r["speedup"] for r in rows if r["speedup"] is not None]
    median, low, high = spread(speedups) if speedups else (None, None, None)
    decode_speedups = [r.get("decode_speedup") for r in rows if r.get("decode_speedup") is not None]
    positions = [r["acceptance_rate_by_position"] for r in rows if r["acceptance_rate_by_position"]]
    by_position = [statistics.fmean(p[i] for p in positions if len(p) > i)
                   for i in range(max(map(len, positions)))] if positions else None
    deltas = [r["target_logprob_mean"] - r["plain_target_logprob_mean"] for r in rows
              if r["target_logprob_mean"] is not None and r["plain_target_logprob_mean"] is not None]
    greedy = first["mode"] == "greedy"
    return {
        "type": "summary", "setting": first["setting"], "method": first["method"], "engine": first["engine"],
        "pair": first["pair"], "k": first["k"], "acceptance": first["acceptance"], "exact": first["exact"],
        "workload": first["workload"], "mode": first["mode"], "runs": len(rows),
        "quantization": first.get("quantization"), "compared_with": first.get("compared_with", "plain"),
        "acceptance_rate": pooled.acceptance_rate, "acceptance_rate_by_position": by_position,
        "mean_accepted_length": pooled.mean_accepted_length, "target_calls_per_token": pooled.target_calls_per_token,
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in rows),
        "first_token_seconds": statistics.median(r["first_token_seconds"] for r in rows),
        "speedup_median": median, "speedup_low": low, "speedup_high": high,
        "decode_speedup_median": statistics.median(decode_speedups) if decode_speedups else None,
        "draft_seconds": _mean(r["draft_seconds"] for r in rows), "verify_seconds": _mean(r["verify_seconds"] for r in rows),
        "other_seconds": _mean(r["other_seconds"] for r in rows),
        "wall_seconds": statistics.fmean(r["wall_seconds"] for r in rows),
        "roofline": _median(r.get("roofline") for r in rows),
        "identical": sum(bool(r["identical_to_plain"]) for r in rows) if greedy else None,
        "first_divergence_median": _median(r["first_divergence"] for r in rows),
        "target_logprob_mean": _mean(r["target_logprob_mean"] for r in rows),
        "plain_target_logprob_mean": _mean(r["plain_target_logprob_mean"] for r in rows),
        "logprob_delta": statistics.fmean(deltas) if deltas else None,
        "logprob_delta_se": statistics.stdev(deltas) / math.sqrt(len(deltas)) if len(deltas) > 1 else None,
        "metric": first["metric"],
        "metric_value": _mean(r["metric_value"] for r in rows),
        "plain_metric_value": _mean(r["plain_metric_value"] for r in rows),
        **_task_scores(rows),
        **_auto_k(rows),
    }


def _auto_k(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """k="auto": the K chosen per decode step (pooled over runs), the share of steps without
    speculation, and the cost model's predicted speedup (median over runs) beside the achieved one."""
    histogram: dict[str, int] = {}
    for r in rows:
        for k, n in (r.get("k_histogram") or {}).items():
            histogram[str(k)] = histogram.get(str(k), 0) + n
    steps = sum(histogram.values())
    return {"k_histogram": dict(sorted(histogram.items(), key=lambda kv: int(kv[0]))) or None,
            "plain_step_share": histogram.get("0", 0) / steps if steps else None,
            "predicted_speedup": _median(r.get("predicted_speedup") for r in rows),
            "measured_speedup": _median(r.get("measured_speedup") for r in rows)}


def _task_scores(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """HumanEval pass@1 (and pass@k over repetitions) and math accuracy, each beside plain decoding's
    on the same prompts, with 95% Wilson intervals. Older records without these fields give None."""
    out: dict[str, Any] = {}
    for name, key, plain_key in (("pass", "passed", "plain_passed"), ("accuracy", "answer_correct", "plain_answer_correct")):
        scored = [r for r in rows if r.get(key) is not None]
        hits = sum(bool(r[key]) for r in scored)
        low, high = wilson_interval(hits, len(scored))
        out[f"{name}_n"] = len(scored)
        out[f"{name}_rate"] = hits / len(scored) if scored else None
        out[f"{name}_low"], out[f"{name}_high"] = low, high
        out[f"plain_{name}_rate"] = statistics.fmean(bool(r[plain_key]) for r in scored) if scored else None
    # pass@k (Chen et al.'s unbiased estimator) when problems were sampled several times.
    per_problem: dict[str, list[bool]] = {}
    for r in rows:
        if r.get("passed") is not None:
            per_problem.setdefault(r["prompt_id"], []).append(bool(r["passed"]))
    n = min(map(len, per_problem.values()), default=0)
    out["pass_at_k"] = {str(k): statistics.fmean(pass_at_k(len(v), sum(v), k) for v in per_problem.values())
                        for k in sorted({1, n})} if n > 1 else None
    return out
