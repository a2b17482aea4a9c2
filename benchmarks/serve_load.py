"""Load test of `verispec serve`: N concurrent streaming clients, speculation on and off.

    python benchmarks/serve_load.py --model smollm2-135m --clients 1 8 32 64 --max-tokens 64 --threads 2
    python benchmarks/serve_load.py --model qwen2.5-coder-1.5b --clients 1 8 32 64 --max-tokens 24 --threads 2

For each mode (``--plain`` and the default drafter, prompt lookup) the script starts `verispec serve`
as its own process, takes the reference answer of every prompt alone, then for each N lets N clients
(the official ``openai`` async client, streaming) send max(N, 8) greedy chat requests between them
(HumanEval and Spec-Bench prompts, distinct per request). It records requests/s, tokens/s, time to
first token and end-to-end latency percentiles, errors (429 counted apart), responses that differ
from their prompt's reference (lost or mixed-up: with greedy decoding and one request decoded at a
time, each answer is determined by its prompt), and the server's resident memory (peak from
/proc/PID/status VmHWM, current after each N, and its anonymous part). ``--distinct`` cycles the
requests through fewer prompts (fewer reference answers to take on slow models). Writes JSON lines (``--out``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai

from verispec.bench.runner import cpu_name
from verispec.bench.workloads import load_workload


def prompts(count: int) -> list[str]:
    """Distinct prompts: half HumanEval, half Spec-Bench (all categories)."""
    spec = list(dict.fromkeys(p.text for p in load_workload("spec_bench", max(1, count // 12))))[: count // 2]
    code = [p.text for p in load_workload("humaneval", count - len(spec))]
    texts = [text for pair in zip(code, spec) for text in pair] + code[len(spec):]  # interleaved
    if len(set(texts)) < count:
        raise SystemExit(f"only {len(set(texts))} distinct prompts found; need {count}")
    return texts


def memory(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    value = lambda key: int(re.search(rf"^{key}:\s+(\d+) kB", status, re.M).group(1)) / 1024
    # RssAnon is the server's own memory; the rest of RSS is clean file pages (weights read by mmap).
    return {"rss_mb": value("VmRSS"), "anon_rss_mb": value("RssAnon"), "peak_rss_mb": value("VmHWM")}


def start_server(args: argparse.Namespace, plain: bool) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "verispec.cli", "-q", "serve", "--model", args.model, "--port", "0",
               "--max-queue", str(args.max_queue)]
    command += ["--plain"] if plain else []
    command += ["--threads", str(args.threads)] if args.threads else []
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in process.stderr:
        match = re.search(r"serving .* on (http://\S+)", line)
        if match:
            # Keep reading the server's log (to our stderr): a full pipe would block the server.
            threading.Thread(target=lambda: [sys.stderr.write(f"[server] {l}") for l in process.stderr],
                             daemon=True).start()
            return process, match.group(1)
        if "error" in line.lower():
            sys.stderr.write(line)
    raise SystemExit(f"the server did not start (exit code {process.wait()})")


async def one_request(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> dict:
    begin = time.perf_counter()
    first = None
    text = []
    final = None
    try:
        stream = await client.chat.completions.create(
            model="served", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - begin
                text.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                final = chunk
    except openai.RateLimitError:
        return {"error": "429"}
    except openai.APIError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if final is None:
        return {"error": "stream ended without a finish reason"}
    return {"text": "".join(text), "ttft": first or time.perf_counter() - begin,
            "latency": time.perf_counter() - begin, "tokens": final.usage.completion_tokens,
            "accepted": final.model_extra["verispec"]["accepted_tokens"]}


async def run_clients(url: str, work: list[tuple[int, str]], clients: int, max_tokens: int) -> tuple[list, float]:
    queue: asyncio.Queue = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    results: list[tuple[int, dict]] = []
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)

    async def worker() -> None:
        while not queue.empty():
            index, prompt = queue.get_nowait()
            results.append((index, await one_request(client, prompt, max_tokens)))

    begin = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.perf_counter() - begin
    await client.close()
    return results, elapsed


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))]


def run_mode(args: argparse.Namespace, plain: bool, texts: list[str]) -> list[dict]:
    process, url = start_server(args, plain)
    rows = []
    try:
        mode = "plain" if plain else "speculative (prompt lookup)"
        print(f"[{mode}] server at {url}; reference answers ...", file=sys.stderr)
        reference, _ = asyncio.run(run_clients(url, list(enumerate(texts)), 1, args.max_tokens))
        expected = {i: r.get("text") for i, r in reference}
        for clients in args.clients:
            count = max(clients, 8)
            work = [(i % len(texts), texts[i % len(texts)]) for i in range(count)]
            results, elapsed = asyncio.run(run_clients(url, work, clients, args.max_tokens))
            done = [r for _, r in results if "error" not in r]
            errors = [r["error"] for _, r in results if "error" in r]
            wrong = sum(1 for i, r in results if "error" not in r and r["text"] != expected[i])
            tokens = sum(r["tokens"] for r in done)
            row = {"model": args.model, "mode": mode, "clients": clients, "requests": count,
                   "completed": len(done), "lost": count - len(results), "mismatched": wrong,
                   "rejected_429": errors.count("429"), "errors": [e for e in errors if e != "429"],
                   "seconds": elapsed, "requests_per_second": len(done) / elapsed,
                   "tokens_per_second": tokens / elapsed,
                   "accepted_per_token": sum(r["accepted"] for r in done) / tokens if tokens else None,
                   **{f"ttft_p{q}": percentile([r["ttft"] for r in done], q) for q in (50, 95, 99)},
                   **{f"latency_p{q}": percentile([r["latency"] for r in done], q) for q in (50, 95, 99)},
                   **memory(process.pid), "cpu": cpu_name(), "machine": platform.machine(),
                   "threads": args.threads, "max_tokens": args.max_tokens}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    return rows


def table(rows: list[dict]) -> str:
    head = ("| model | mode | clients | requests | ok | lost | mixed-up | 429 | other errors | req/s | tok/s | "
            "TTFT p50/p95/p99 s | latency p50/p95/p99 s | server RSS now (anonymous) / peak MB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        fmt = lambda *keys: "/".join(f"{r[k]:.2f}" for k in keys)
        lines.append(f"| {r['model']} | {r['mode']} | {r['clients']} | {r['requests']} | {r['completed']} | "
                     f"{r['lost']} | {r['mismatched']} | {r['rejected_429']} | {len(r['errors'])} | "
                     f"{r['requests_per_second']:.2f} | {r['tokens_per_second']:.1f} | "
                     f"{fmt('ttft_p50', 'ttft_p95', 'ttft_p99')} | {fmt('latency_p50', 'latency_p95', 'latency_p99')} | "
                     f"{r['rss_mb']:.0f} ({r['anon_rss_mb']:.0f}) / {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--distinct", type=int, default=None,
                        help="Distinct prompts (default: one per request of the largest N); requests cycle through them")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--modes", nargs="+", choices=["plain", "speculative"], default=["plain", "speculative"])
    parser.add_argument("--out", default=None, help="JSON lines file to append the rows to")
    args = parser.parse_args()
    texts = prompts(args.distinct or max(max(args.clients), 8))
    rows = []
    for mode in args.modes:
        rows += run_mode(args, mode == "plain", texts)
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores, threads {args.threads}; {args.max_tokens} new tokens, greedy, chat")
    print(table(rows))


if __name__ == "__main__":
    main()
