"""``verispec bench``: plain decoding and every method on the same prompts, interleaved, one JSON
line per run (see ``verispec.bench.records`` for the file layout)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from verispec.bench.checks import TaskChecks
from verispec.bench.config import BenchConfig, Setting
from verispec.bench.engines import Engines, prompt_ids, weight_bytes_per_token
from verispec.bench.interleave import run_interleaved
from verispec.bench.records import SCHEMA_VERSION, make_record, mode_label
from verispec.bench.workloads import Prompt, load_workload
from verispec.errors import VerispecError
from verispec.machine import cpu_name
from verispec.sampling import SamplingConfig


def hardware(threads: int | None = None) -> dict[str, Any]:
    accelerator = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": threads or torch.get_num_threads(),
            "isa": torch.backends.cpu.get_cpu_capability(), "accelerator": accelerator, "device": "cpu"}


def versions() -> dict[str, str]:
    import transformers

    import verispec

    return {"verispec": verispec.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def read_bandwidth_gbs(megabytes: int = 1024, repeats: int = 5) -> float:
    """Best-of-n streaming read bandwidth: sum a large fp32 tensor (each byte read once)."""
    data = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def _progress(total: int, enabled: bool) -> Any:
    """A tqdm bar on stderr: one tick per run, the latest run's speed as its postfix."""
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, unit="run", desc="bench", dynamic_ncols=True)


def _encode(engines: Engines, config: BenchConfig) -> list[tuple[Prompt, list[int], bool]]:
    prompts = [p for name in config.workloads for p in load_workload(name, config.prompts, config.data_dir)]
    if not prompts:
        raise VerispecError("the workloads hold no prompts")
    encoded = []
    for p in prompts:
        ids, chat = prompt_ids(engines.target, p, config.chat)
        if len(ids) + config.max_new_tokens > engines.target.config.max_position_embeddings:
            raise VerispecError(f"prompt {p.workload}/{p.id} ({len(ids)} tokens) + max_new_tokens exceeds the context")
        encoded.append((p, ids, chat))
    return encoded


def _context(config: BenchConfig, setting: Setting, prompt: Prompt, chat: bool, sampling: SamplingConfig,
             repetition: int, environment: dict[str, Any]) -> dict[str, Any]:
    """What a record says about the run around its stats."""
    return {"setting": setting.label, "params": setting.params, "target": config.target,
            "pair": setting.pair(config.target), "acceptance": setting.acceptance,
            "hardware": environment["hardware"], "versions": environment["versions"], "dtype": config.dtype,
            "quantization": setting.quantize, "timing": config.timing, "prefill_chunk": config.prefill_chunk,
            "workload": prompt.workload, "prompt_id": prompt.id, "chat_template": chat, "repetition": repetition,
            "mode": mode_label(sampling.temperature, sampling.top_k, sampling.top_p),
            "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}


def _prompt_runs(engines: Engines, config: BenchConfig, order: list[Setting], ids: list[int], sampling: SamplingConfig,
                 seed: int) -> Iterator[tuple[Setting, Any, Any]]:
    """(setting, run, the plain run it compares with) for the plain runs and then every method in
    ``order``, on one prompt.

    Sequential: each run whole, one after another; every method compares with the prompt's one plain run
    at its quantization. Interleaved: the plain runs step together, and then each method steps together
    with a plain run of its own (two runs at a time, the method's baseline made beside it), so a run
    shares the processor's caches with one other run, close to a run made alone, rather than with every
    run of the prompt (BENCHMARKS.md section 15 compares the two).
    """
    plains = config.plains
    if config.timing == "interleaved":
        def start(setting: Setting) -> Any:
            return engines.start(setting, ids, sampling, config.max_new_tokens, seed)

        made = run_interleaved([start(s) for s in plains])
        for s, run in zip(plains, made):
            yield s, run, made[0] if s is not plains[0] else None
        for setting in order:
            base_setting = next(q for q in plains if q.quantize == setting.quantize)
            base, run = run_interleaved([start(base_setting), start(setting)])
            yield setting, run, base
        return
    plain: dict[str | None, Any] = {}  # plain runs of this prompt, by quantization
    for setting in [*plains, *order]:
        run = engines.run(setting, ids, sampling, config.max_new_tokens, seed)
        if setting in plains:
            plain[setting.quantize] = run
            yield setting, run, plain[plains[0].quantize] if setting is not plains[0] else None
        else:
            yield setting, run, plain[setting.quantize]


def run_bench(config: BenchConfig, out: str | Path, overwrite: bool = False, progress: bool = True,
              say: Callable[[str], None] = lambda message: None) -> Path:
    """Run the experiment ``config`` describes and write its JSONL results to ``out``.

    ``say`` receives one line per phase (loading, warm-up, done); ``progress`` shows a bar per run.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise VerispecError(f"{out} exists; pass --overwrite to replace it, or choose another --output")
    if config.threads:
        torch.set_num_threads(config.threads)
    say(f"[bench] loading {config.target} and {len(config.settings)} method setting(s)")
    engines = Engines(config)
    encoded = _encode(engines, config)
    environment = {"hardware": hardware(config.threads), "versions": versions()}
    if config.roofline:
        environment["read_bandwidth_gbs"] = read_bandwidth_gbs()
        say(f"[bench] measured read bandwidth: {environment['read_bandwidth_gbs']:.1f} GB/s")
    weight_bytes = {q: weight_bytes_per_token(t) for q, t in engines.targets.items()} if config.roofline else {}
    checks = TaskChecks(execute=config.execute)
    if config.execute and any(p.tests for p, _, _ in encoded):
        say("[bench] HumanEval completions will be executed against their tests, each in a confined process "
            "(--no-execute turns this off)")
    plains = config.plains
    settings = [*plains, *config.settings]
    plan = [(p, ids, chat, sampling, rep) for sampling in config.samplings for rep in range(config.repetitions)
            for (p, ids, chat) in encoded]
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        meta = {"type": "meta", "schema": SCHEMA_VERSION, "started": datetime.datetime.now().isoformat(timespec="seconds"),
                "config": config.as_dict(), **environment, "prompts": len(encoded), "runs": len(plan) * len(settings)}
        f.write(json.dumps(meta) + "\n")
        f.flush()
        if config.warmup_tokens:  # kernels compile, low-rank factors and caches are built outside the timings
            say(f"[bench] warm-up: every setting once on one prompt per decoding mode, {config.warmup_tokens} tokens "
                "(not recorded)")
            # Every mode: k="auto" measures a cost curve per way of judging a row (greedy, sampled, ...); in
            # the first recorded run of a mode it took 1.5 s of a 2.9 s run (SmolLM2, T = 0.7: 0.50x).
            for sampling in config.samplings:
                for setting in settings:
                    engines.run(setting, encoded[0][1], sampling, config.warmup_tokens, config.seed)
        written = 0
        with _progress(meta["runs"], progress) as bar:
            for index, (p, ids, chat, sampling, rep) in enumerate(plan):
                seed = config.seed + index
                # Plain first, then every method on the same prompt. The methods' order turns by one per
                # prompt, so no method always runs right after plain (on a shared machine a position in the
                # sequence can be systematically faster or slower).
                turn = index % len(config.settings) if config.settings else 0
                order = [*config.settings[turn:], *config.settings[:turn]]
                for setting, run, base in _prompt_runs(engines, config, order, ids, sampling, seed):
                    # A method compares with plain decoding of the same target; a plain run with the first.
                    base_setting = plains[0] if setting in plains else next(q for q in plains if q.quantize == setting.quantize)
                    context = _context(config, setting, p, chat, sampling, rep, environment)
                    context["compared_with"] = base_setting.label
                    record = make_record(context, run, base,
                                         sampling.greedy, p.reference, p.metric, weight_bytes.get(setting.quantize),
                                         environment.get("read_bandwidth_gbs"))
                    record.update(checks.checks(p, run.text or "", (base or run).text or ""))
                    f.write(json.dumps(record) + "\n")
                    f.flush()
                    written += 1
                    speed = f"{record['tokens_per_second']:.1f} tok/s"
                    if setting is not plains[0]:
                        speed += f", {record['speedup']:.2f}x"
                    bar.set_postfix_str(f"{p.workload}/{p.id} {record['mode']} {setting.label}: {speed}", refresh=False)
                    bar.update()
    say(f"[bench] wrote {written} records to {out}")
    return out


__all__ = ["hardware", "read_bandwidth_gbs", "run_bench", "versions"]
