"""Final numeric answers of math questions: the reference's, the model's, and whether they agree.

References: Spec-Bench ``math_reasoning`` (GSM8K) ends every reference with ``#### N``. The ten
MT-Bench ``math`` questions have prose references ("Area is 3", "38 people", "f(2) = 0"); their
numbers were read by hand from those references and are listed in ``MT_BENCH_MATH`` (first turn).

The model's answer, a documented rule applied in order:

1. the number after the last ``####`` (the GSM8K format, which models trained on it write);
2. else the number inside the last ``\\boxed{...}``;
3. else the first number after the last "answer is" / "answer:" (any case);
4. else the last number in the text.

Numbers are integers, decimals or fractions (``35/36``), with thousands commas, a leading ``$`` and
a trailing ``%`` ignored; two answers agree when their values differ by less than 1e-6 (relative).
"""

from __future__ import annotations

import re
from fractions import Fraction

NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?%?"

# question_id -> the number in the first turn's reference (read by hand; see the module docstring).
MT_BENCH_MATH = {"111": "3", "112": "12000", "113": "19", "114": "35/36", "115": "38", "116": "0", "117": "19",
                 "118": "0", "119": "280", "120": "0"}


def value(text: str) -> Fraction | None:
    """A number as written (``1,000``, ``$5``, ``19%``, ``35/36``, ``-2.5``) -> its exact value."""
    cleaned = text.replace(",", "").replace("$", "").replace("%", "").replace(" ", "")
    try:
        if "/" in cleaned:
            top, bottom = cleaned.split("/")
            return Fraction(top) / Fraction(bottom)
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def reference_answer(reference: str | None) -> str | None:
    """The number after ``####`` in a GSM8K-style reference; None when there is none."""
    if not reference:
        return None
    found = re.findall(r"####\s*(" + NUMBER + ")", reference)
    return found[-1].strip() if found else None


def model_answer(text: str) -> str | None:
    """The model's final answer by the rule in the module docstring; None when the text has no number."""
    for pattern in (r"####\s*(" + NUMBER + ")", r"\\boxed\{\s*(" + NUMBER + r")\s*\}"):
        found = re.findall(pattern, text)
        if found:
            return found[-1].strip()
    lowered = text.lower()
    at = max(lowered.rfind("answer is"), lowered.rfind("answer:"))
    if at >= 0:
        after = re.search(NUMBER, text[at:])
        if after:
            return after.group(0).strip()
    numbers = re.findall(NUMBER, text)
    return numbers[-1].strip() if numbers else None


def same_number(a: str | None, b: str | None) -> bool:
    va, vb = (value(a) if a else None), (value(b) if b else None)
    if va is None or vb is None:
        return False
    return abs(va - vb) <= Fraction(1, 10**6) * max(1, abs(vb))


def answer_correct(text: str, expected: str | None) -> bool | None:
    """Whether ``text``'s final answer equals ``expected``; None when there is nothing to compare with."""
    if expected is None:
        return None
    return same_number(model_answer(text), expected)
