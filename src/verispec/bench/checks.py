"""Task checks of one run beside plain decoding's: HumanEval executed, math answers scored.

HumanEval completions run through ``verispec.bench.execution`` (a confined process per sample, never
the bench process); a verdict is cached by (problem, completion), so methods whose output equals plain
decoding's (every exact method under greedy int8, for one) cost one execution, not one each.
"""

from __future__ import annotations

from typing import Any

from verispec.bench.answers import answer_correct, model_answer
from verispec.bench.execution import Verdict, check_correctness, completion_code
from verispec.bench.workloads import Prompt

FIELDS = ("passed", "plain_passed", "exec_result", "expected_answer", "model_answer", "answer_correct",
          "plain_answer_correct")


class TaskChecks:
    def __init__(self, execute: bool = True) -> None:
        self.execute = execute
        self._verdicts: dict[tuple[str, str], Verdict] = {}

    def verdict(self, prompt: Prompt, text: str) -> Verdict:
        code = completion_code(text)
        key = (prompt.id, code)
        if key not in self._verdicts:
            test, entry_point = prompt.tests
            problem = {"prompt": prompt.text, "test": test, "entry_point": entry_point}
            self._verdicts[key] = check_correctness(problem, code)
        return self._verdicts[key]

    def checks(self, prompt: Prompt, text: str, plain_text: str) -> dict[str, Any]:
        """The record fields (``FIELDS``) for a run whose output is ``text`` (plain decoding's: ``plain_text``)."""
        out: dict[str, Any] = dict.fromkeys(FIELDS)
        if prompt.tests is not None and self.execute:
            run = self.verdict(prompt, text)
            out.update(passed=run.passed, exec_result=run.result,
                       plain_passed=self.verdict(prompt, plain_text).passed)
        if prompt.answer is not None:
            out.update(expected_answer=prompt.answer, model_answer=model_answer(text),
                       answer_correct=answer_correct(text, prompt.answer),
                       plain_answer_correct=answer_correct(plain_text, prompt.answer))
        return out
