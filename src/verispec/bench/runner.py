"""``verispec bench``: plain decoding and every method on the same prompts, interleaved, one JSON
line per run, then a summary per (method setting, workload, decoding mode).

File layout (JSON Lines): a ``{"type": "meta"}`` line (config, hardware, versions), one
``{"type": "record"}`` line per (setting, prompt, decoding mode, repetition), written and flushed as
each run ends (an interrupted benchmark keeps what it measured), and ``{"type": "summary"}`` lines.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from verispec.bench.config import PLAIN, BenchConfig, Setting
from verispec.bench.engines import Outcome, load_hf, make_drafter, run_transformers, run_verispec
from verispec.bench.metrics import METRICS, first_divergence
from verispec.bench.workloads import Prompt, load_workload
from verispec.decoding import encode_prompt
from verispec.errors import VerispecError
from verispec.models.loading import load_model, parse_dtype
from verispec.sampling import SamplingConfig

SCHEMA_VERSION = 1


def hardware(threads: int | None = None) -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    accelerator = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": threads or torch.get_num_threads(),
            "isa": torch.backends.cpu.get_cpu_capability(), "accelerator": accelerator, "device": "cpu"}


def versions() -> dict[str, str]:
    import transformers

    import verispec

    return {"verispec": verispec.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


class Progress:
    """``[bench 12/84 14%] label | elapsed 3m02s, ETA 18m40s`` on stderr, one line per run."""

    def __init__(self, total: int, enabled: bool = True, stream: Any = None) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        self.stream.write(f"[bench {self.done}/{self.total} {self.done / self.total:.0%}] {label} | "
                          f"elapsed {_clock(elapsed)}, ETA {_clock(eta)}\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _mode(sampling: SamplingConfig) -> str:
    if sampling.greedy:
        return "greedy"
    parts = [f"T={sampling.temperature:g}"]
    if sampling.top_k:
        parts.append(f"top_k={sampling.top_k}")
    if sampling.top_p < 1:
        parts.append(f"top_p={sampling.top_p:g}")
    return " ".join(parts)


def _pair_description(config: BenchConfig, setting: Setting) -> str:
    """The model pair, or the approximation of the target, in words."""
    p = setting.params
    if setting.method in ("plain", "hf-plain"):
        return config.target
    if "draft" in p:
        return f"{p['draft']} -> {config.target}"
    if setting.method == "layer-skip":
        parts = [f"layers {p['skip']}" if p.get("skip") else "", f"attention of {p['skip_attention']}" if p.get("skip_attention") else "",
                 f"MLP of {p['skip_mlp']}" if p.get("skip_mlp") else ""]
        return f"{config.target} skipping " + ", ".join(x for x in parts if x)
    if setting.method == "early-exit":
        return f"{config.target} exiting at layer {p['layer']}"
    if setting.method == "low-rank":
        return f"{config.target} with " + (f"rank {p['rank']}" if "rank" in p else f"{p['energy']:.0%} energy") + " factors"
    return f"{config.target} with {setting.method} (n-gram {p.get('ngram', 3)})"


class Engines:
    """Models and drafters, loaded once per benchmark and shared by every run."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.target = load_model(config.target, dtype=config.dtype)
        self.drafters: dict[str, Any] = {}
        self.draft_models: dict[str, Any] = {}
        self.hf_target = None
        self.hf_drafts: dict[str, Any] = {}
        for setting in config.settings:
            if setting.engine == "verispec":
                self.drafters[setting.label] = self._drafter(setting)
            else:
                if self.hf_target is None:
                    self.hf_target = load_hf(config.target, parse_dtype(config.dtype))
                if "draft" in setting.params and setting.params["draft"] not in self.hf_drafts:
                    self.hf_drafts[setting.params["draft"]] = load_hf(setting.params["draft"], parse_dtype(config.dtype))

    def _drafter(self, setting: Setting) -> Any:
        from verispec.drafters import DraftModel

        if setting.method == "draft-model":
            name = setting.params["draft"]
            if name not in self.draft_models:
                self.draft_models[name] = load_model(name, dtype=self.config.dtype)
            return DraftModel(self.draft_models[name], k=setting.k)
        return make_drafter(setting)

    def run(self, setting: Setting, prompt_ids: list[int], sampling: SamplingConfig, max_new_tokens: int,
            seed: int) -> Outcome:
        sampling = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        if setting.engine == "transformers":
            assistant = self.hf_drafts.get(setting.params.get("draft"))
            return run_transformers(self.hf_target, assistant, self.target.tokenizer, prompt_ids, sampling, setting,
                                    max_new_tokens, self.config.ignore_eos, seed)
        drafter = self.drafters.get(setting.label)
        return run_verispec(self.target, drafter, prompt_ids, sampling, setting, max_new_tokens, self.config.ignore_eos)


def prompt_ids(model: Any, prompt: Prompt, chat: str) -> tuple[list[int], bool]:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise VerispecError(f"{model.name} has no tokenizer: benchmarks need text prompts")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    use_chat = not prompt.completion and (chat == "always" or (chat == "auto" and has_template))
    if use_chat and not has_template:
        raise VerispecError(f"chat = 'always' but {model.name}'s tokenizer has no chat template")
    return encode_prompt(model, prompt.text, chat=use_chat), use_chat


def make_record(config: BenchConfig, setting: Setting, prompt: Prompt, n_prompt_tokens: int, chat: bool,
                sampling: SamplingConfig, seed: int, repetition: int, outcome: Outcome, plain: Outcome | None,
                environment: dict[str, Any]) -> dict[str, Any]:
    n = len(outcome.token_ids)
    tps = n / outcome.wall_seconds if outcome.wall_seconds > 0 else 0.0
    decode_seconds = outcome.wall_seconds - outcome.first_token_seconds
    drafted, accepted = outcome.drafted_tokens, outcome.accepted_tokens
    greedy = sampling.greedy
    metric = METRICS[prompt.metric] if prompt.metric else None
    other = None
    if outcome.draft_seconds is not None and outcome.verify_seconds is not None:
        other = max(0.0, outcome.wall_seconds - outcome.draft_seconds - outcome.verify_seconds
                    - (outcome.first_token_seconds if setting.engine == "verispec" else 0.0))
    base = plain or outcome
    plain_tps = len(base.token_ids) / base.wall_seconds if base.wall_seconds > 0 else 0.0
    return {
        "type": "record", "schema": SCHEMA_VERSION,
        "method": setting.method, "setting": setting.label, "engine": setting.engine, "params": setting.params,
        "target": config.target, "pair": _pair_description(config, setting), "k": setting.k,
        "acceptance": setting.acceptance, "exact": outcome.exact,
        "hardware": environment["hardware"], "versions": environment["versions"], "dtype": config.dtype,
        "workload": prompt.workload, "prompt_id": prompt.id, "chat_template": chat, "repetition": repetition,
        "prompt_tokens": n_prompt_tokens, "output_tokens": n,
        "mode": "greedy" if greedy else "sampled", "temperature": sampling.temperature,
        "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": seed,
        "target_calls": outcome.target_calls, "draft_calls": outcome.draft_calls,
        "drafted_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "acceptance_by_position": outcome.acceptance_by_position,
        "mean_accepted_length": outcome.mean_accepted_length,
        "target_calls_per_token": outcome.target_calls / n if n else None,
        "latency_s": outcome.wall_seconds, "ttft_s": outcome.first_token_seconds,
        "per_token_latency_s": decode_seconds / (n - 1) if n > 1 else None,
        "tokens_per_s": tps, "decode_tokens_per_s": (n - 1) / decode_seconds if n > 1 and decode_seconds > 0 else None,
        "draft_s": outcome.draft_seconds, "verify_s": outcome.verify_seconds, "other_s": other,
        "speedup": tps / plain_tps if plain_tps > 0 else None,
        "identical_to_plain": (outcome.token_ids == base.token_ids) if greedy else None,
        "first_divergence": first_divergence(outcome.token_ids, base.token_ids) if greedy else None,
        "target_logprob_mean": statistics.fmean(outcome.target_logprobs) if outcome.target_logprobs else None,
        "plain_target_logprob_mean": statistics.fmean(base.target_logprobs) if base.target_logprobs else None,
        "metric": prompt.metric,
        "metric_value": metric(outcome.text, prompt.reference) if metric else None,
        "plain_metric_value": metric(base.text, prompt.reference) if metric else None,
        "settings": outcome.settings, "output_text": outcome.text, "output_ids": outcome.token_ids,
    }


def _spread(values: list[float]) -> tuple[float, float, float]:
    """Median and the 25th/75th percentiles (min/max for fewer than 4 values)."""
    values = sorted(values)
    if len(values) < 4:
        return statistics.median(values), values[0], values[-1]
    q = statistics.quantiles(values, n=4)
    return statistics.median(values), q[0], q[2]


def summarise(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per (setting, workload, mode), from the records alone (so partial files summarise too)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("type") == "record":
            mode = "greedy" if r["mode"] == "greedy" else f"T={r['temperature']:g} top_k={r['top_k']} top_p={r['top_p']:g}"
            groups.setdefault((r["setting"], r["workload"], mode), []).append(r)
    out = []
    for (setting, workload, mode), rows in groups.items():
        first = rows[0]
        drafted = [r["drafted_tokens"] for r in rows if r["drafted_tokens"] is not None]
        accepted = [r["accepted_tokens"] for r in rows if r["accepted_tokens"] is not None]
        speedups = [r["speedup"] for r in rows if r["speedup"] is not None]
        median, low, high = _spread(speedups) if speedups else (None, None, None)
        positions = [r["acceptance_by_position"] for r in rows if r["acceptance_by_position"]]
        by_position = [statistics.fmean(p[i] for p in positions if len(p) > i)
                       for i in range(max(map(len, positions)))] if positions else None
        deltas = [r["target_logprob_mean"] - r["plain_target_logprob_mean"] for r in rows
                  if r["target_logprob_mean"] is not None and r["plain_target_logprob_mean"] is not None]
        tokens = sum(r["output_tokens"] for r in rows)
        summary = {
            "type": "summary", "setting": setting, "method": first["method"], "engine": first["engine"],
            "pair": first["pair"], "k": first["k"], "acceptance": first["acceptance"], "exact": first["exact"],
            "workload": workload, "mode": mode, "runs": len(rows),
            "acceptance_rate": sum(accepted) / sum(drafted) if drafted and len(accepted) == len(drafted) and sum(drafted) else None,
            "acceptance_by_position": by_position,
            "mean_accepted_length": statistics.fmean(r["mean_accepted_length"] for r in rows),
            "target_calls_per_token": sum(r["target_calls"] for r in rows) / tokens if tokens else None,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "ttft_s": statistics.median(r["ttft_s"] for r in rows),
            "speedup_median": median, "speedup_low": low, "speedup_high": high,
            "draft_s": _mean_or_none(r["draft_s"] for r in rows), "verify_s": _mean_or_none(r["verify_s"] for r in rows),
            "other_s": _mean_or_none(r["other_s"] for r in rows),
            "latency_s": statistics.fmean(r["latency_s"] for r in rows),
            "identical": sum(bool(r["identical_to_plain"]) for r in rows) if first["mode"] == "greedy" else None,
            "first_divergence_median": _median_or_none(r["first_divergence"] for r in rows if r["first_divergence"] is not None),
            "target_logprob_mean": _mean_or_none(r["target_logprob_mean"] for r in rows),
            "plain_target_logprob_mean": _mean_or_none(r["plain_target_logprob_mean"] for r in rows),
            "logprob_delta": statistics.fmean(deltas) if deltas else None,
            "logprob_delta_se": statistics.stdev(deltas) / math.sqrt(len(deltas)) if len(deltas) > 1 else None,
            "metric": first["metric"],
            "metric_value": _mean_or_none(r["metric_value"] for r in rows),
            "plain_metric_value": _mean_or_none(r["plain_metric_value"] for r in rows),
        }
        out.append(summary)
    return out


def _mean_or_none(values: Iterable[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _median_or_none(values: Iterable[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def read_results(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(meta, records) of a results file; summaries are recomputed by whoever needs them."""
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
    if not records:
        raise VerispecError(f"{path} holds no measured runs yet")
    return meta, records


def run_bench(config: BenchConfig, out: str | Path, overwrite: bool = False, progress: bool = True,
              log: Callable[[str], None] | None = None) -> Path:
    """Run the experiment ``config`` describes and write its JSONL results to ``out``."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise VerispecError(f"{out} exists; pass --overwrite to replace it, or choose another --output")
    say = log or (lambda message: print(message, file=sys.stderr, flush=True))
    prompts = [p for name in config.workloads for p in load_workload(name, config.prompts, config.data_dir)]
    if not prompts:
        raise VerispecError("the workloads hold no prompts")
    if config.threads:
        torch.set_num_threads(config.threads)
    say(f"[bench] loading {config.target} and {len(config.settings)} method setting(s)")
    engines = Engines(config)
    encoded = []
    for p in prompts:
        ids, chat = prompt_ids(engines.target, p, config.chat)
        if len(ids) + config.max_new_tokens > engines.target.config.max_position_embeddings:
            raise VerispecError(f"prompt {p.workload}/{p.id} ({len(ids)} tokens) + max_new_tokens exceeds the context")
        encoded.append((p, ids, chat))
    environment = {"hardware": hardware(config.threads), "versions": versions()}
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = [PLAIN, *config.settings]
    plan = [(p, ids, chat, sampling, rep) for sampling in config.samplings for rep in range(config.repetitions)
            for (p, ids, chat) in encoded]
    meter = Progress(len(plan) * len(settings), enabled=progress)
    with out.open("w") as f:
        meta = {"type": "meta", "schema": SCHEMA_VERSION, "started": datetime.datetime.now().isoformat(timespec="seconds"),
                "config": config.as_dict(), **environment, "prompts": len(prompts), "runs": meter.total}
        f.write(json.dumps(meta) + "\n")
        f.flush()
        if config.warmup_tokens:  # kernels compile, low-rank factors and caches are built outside the timings
            say(f"[bench] warm-up: every setting once on one prompt, {config.warmup_tokens} tokens (not recorded)")
            for setting in settings:
                engines.run(setting, encoded[0][1], config.samplings[0], config.warmup_tokens, config.seed)
        meter.start = time.perf_counter()  # the ETA extrapolates measured runs, not the warm-up
        records = []
        for index, (p, ids, chat, sampling, rep) in enumerate(plan):
            seed = config.seed + index
            plain = None
            for setting in settings:  # plain first, then every method on the same prompt: interleaved
                outcome = engines.run(setting, ids, sampling, config.max_new_tokens, seed)
                plain = plain or outcome
                record = make_record(config, setting, p, len(ids), chat, sampling, seed, rep, outcome,
                                     None if setting is PLAIN else plain, environment)
                records.append(record)
                f.write(json.dumps(record) + "\n")
                f.flush()
                speed = f"{record['tokens_per_s']:.1f} tok/s"
                if setting is not PLAIN:
                    speed += f", speedup {record['speedup']:.2f}x"
                meter.step(f"{p.workload}/{p.id} {_mode(sampling)} {setting.label}: {speed}")
        for summary in summarise(records):
            f.write(json.dumps(summary) + "\n")
    say(f"[bench] wrote {len(records)} records and their summaries to {out}")
    return out


__all__ = ["Progress", "hardware", "make_record", "read_results", "run_bench", "summarise", "versions"]
