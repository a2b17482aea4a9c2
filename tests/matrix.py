"""The distribution matrix: every drafter x temperature x truncation x K, each a whole-sequence
chi-square against the law computed by enumeration, with negative controls in the same run.

    python -m tests.matrix --samples 4000 --out results/exactness-matrix.jsonl

(A script beside the tests, not collected by pytest: it uses their harness and negative controls. The
suite's distribution tests are its fast subset in CI.)

Each configuration samples ``--samples`` runs of 6 new tokens (vocabulary 3: 729 sequences, enumerated
exactly) and tests their counts against the target's law (cells expected below 5 pooled). The tests
are many, so the decision uses a Bonferroni correction: with m configurations (negative controls
included), a configuration fails when p < alpha / m (family-wise alpha = 0.01 by default). Exact
configurations must all pass; every negative control must fail at the same threshold. One JSON line
per configuration goes to ``--out``; the summary table is printed and written beside it (``.md``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import sys
import time
from pathlib import Path

import torch

import verispec
from tests.distribution import chi_square_pvalue, exact_distribution, sample_with_exercise
from tests.test_speculative import (AlwaysAccept, KeepsOneRejected, ResidualFromTheWrongRow, SwitchesLawAfterTheFirst,
                                    TrustingTable)
from verispec.sampling import SamplingConfig
from verispec.testing import TableModel, tiny_model

DRAFTERS = ["draft-model", "layer-skip", "early-exit", "low-rank", "prompt-lookup", "deterministic"]
TEMPERATURES = [0.6, 1.0, 1.5]
TRUNCATIONS = {"none": {}, "top-k 2": {"top_k": 2}, "top-p 0.7": {"top_p": 0.7}}
KS = [1, 2, 4, 8]
CONTROLS = ["always-accept", "residual-from-the-wrong-row", "switches-law-after-the-first", "rollback-keeps-one-rejected"]
PROMPT = [1, 2, 1, 2]  # repeats, so prompt lookup finds matches
# Flat enough that every (temperature, truncation) cell leaves a law with room to be wrong in: at
# T = 0.6 with top-p 0.7 a sharper model keeps one token per step, a single possible sequence, and a
# chi-square that no wrong rule can fail. Each configuration must have MIN_CELLS sequences expected at
# least 5 times, or it is reported DEGENERATE (a failure, never a pass).
TRANSFORMER_SHARPNESS, TABLE_SHARPNESS = 1.5, 0.7
MIN_CELLS = 10


class Pattern(verispec.DrafterBase):
    """A deterministic drafter (no q): proposes a fixed token pattern."""

    method = "deterministic"

    def propose(self, context, k):
        last = context.tokens[-1]
        return verispec.Proposal(torch.tensor([(last + i + 1) % 3 for i in range(k)]), None)


def _models(kind: str):
    if kind in ("layer-skip", "early-exit", "low-rank"):  # the target's own layers draft: a transformer
        return tiny_model(vocab=3, seed=5, layers=3, hidden=16, sharpness=TRANSFORMER_SHARPNESS), None
    return TableModel(vocab=3, seed=0, sharpness=TABLE_SHARPNESS), TableModel(vocab=3, seed=99, sharpness=TABLE_SHARPNESS)


def _make(kind: str, k: int, draft):
    return {"draft-model": lambda: verispec.DraftModel(draft, k=k),
            "layer-skip": lambda: verispec.LayerSkip(skip=[1], skip_mlp=[2], k=k),
            "early-exit": lambda: verispec.EarlyExit(layer=2, k=k),
            "low-rank": lambda: verispec.LowRank(rank=8, k=k),
            "prompt-lookup": lambda: verispec.PromptLookup(ngram=1, k=k),
            "deterministic": lambda: Pattern(k)}[kind]


def run_one(config: dict) -> dict:
    torch.set_num_threads(1)
    kind, control = config["drafter"], config.get("control")
    target, draft = _models(kind)
    sampling = SamplingConfig(config["temperature"], **TRUNCATIONS[config["truncation"]])
    law = exact_distribution(target, sampling, prompt=PROMPT)
    make, acceptance = _make(kind, config["k"], draft), None
    if control == "always-accept":
        acceptance = AlwaysAccept()
    elif control == "residual-from-the-wrong-row":
        acceptance = ResidualFromTheWrongRow()
    elif control == "switches-law-after-the-first":
        make = lambda: SwitchesLawAfterTheFirst(draft, k=config["k"])
    elif control == "rollback-keeps-one-rejected":
        target = TrustingTable(vocab=3, seed=0, sharpness=TABLE_SHARPNESS)
        target.new_cache = lambda capacity: KeepsOneRejected(capacity + 6)
    start = time.perf_counter()
    counts, exercise = sample_with_exercise(target, make, sampling, config["samples"], acceptance=acceptance,
                                            prompt=PROMPT)
    cells = sum(p * config["samples"] >= 5 for p in law.values())
    return {**config, "pvalue": chi_square_pvalue(counts, law), "cells": cells, "seconds": time.perf_counter() - start,
            "runs_accepting_2_in_a_step": exercise.deep_steps, "runs_with_2_proposals": exercise.multi_round,
            "max_k_judged": exercise.max_k}


def plan(samples: int) -> list[dict]:
    configs = [{"drafter": d, "temperature": t, "truncation": tr, "k": k, "samples": samples, "control": None}
               for d, t, tr, k in itertools.product(DRAFTERS, TEMPERATURES, TRUNCATIONS, KS)]
    controls = [{"drafter": "draft-model", "temperature": t, "truncation": tr, "k": 4, "samples": samples, "control": c}
                for c in CONTROLS for t, tr in ((1.0, "none"), (0.6, "top-p 0.7"))]
    return controls + configs  # the controls first: a partial run still shows they are caught


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4000, help="runs per configuration")
    parser.add_argument("--alpha", type=float, default=0.01, help="family-wise significance level")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="results/exactness-matrix.jsonl")
    parser.add_argument("--resume", action="store_true", help="keep the configurations already in --out (same "
                        "samples) and run only the others")
    args = parser.parse_args()
    from tqdm import tqdm

    configs = plan(args.samples)
    threshold = args.alpha / len(configs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    key = lambda c: (c["drafter"], c["temperature"], c["truncation"], c["k"], c["samples"], c["control"])
    if args.resume and out.exists():
        wanted = {key(c) for c in configs}
        rows = [r for r in map(json.loads, out.read_text().splitlines()) if key(r) in wanted]
    done = {key(r) for r in rows}
    todo = [c for c in configs if key(c) not in done]
    with out.open("w") as f, multiprocessing.Pool(args.workers) as pool:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        for row in tqdm(pool.imap_unordered(run_one, todo), total=len(todo), desc="matrix", unit="config"):
            if row["cells"] < MIN_CELLS:
                row["verdict"] = "DEGENERATE"
            elif row["control"]:
                row["verdict"] = "caught" if row["pvalue"] < threshold else "MISSED"
            else:
                row["verdict"] = "pass" if row["pvalue"] >= threshold else "FAIL"
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
    exact = [r for r in rows if not r["control"]]
    controls = [r for r in rows if r["control"]]
    lines = [f"Configurations: {len(exact)} exact + {len(controls)} negative controls, {args.samples} runs each, "
             f"6 tokens judged (729 sequences). Bonferroni: fail when p < {args.alpha} / {len(configs)} = {threshold:.2e}.",
             f"Each configuration's law must leave at least {MIN_CELLS} sequences expected 5+ times (fewest here: "
             f"{min(r['cells'] for r in rows)}).",
             "", f"Exact configurations passing: {sum(r['verdict'] == 'pass' for r in exact)} / {len(exact)}; "
             f"negative controls caught: {sum(r['verdict'] == 'caught' for r in controls)} / {len(controls)}.", "",
             "| drafter | configurations | passed | smallest p | runs accepting 2+ in a step (min over configs with K >= 2) |",
             "|---|---|---|---|---|"]
    for drafter in DRAFTERS:
        group = [r for r in exact if r["drafter"] == drafter]
        deep = min(r["runs_accepting_2_in_a_step"] for r in group if r["k"] >= 2)
        lines.append(f"| {drafter} | {len(group)} | {sum(r['verdict'] == 'pass' for r in group)} | "
                     f"{min(r['pvalue'] for r in group):.2e} | {deep} |")
    lines += ["", "| negative control | T | truncation | p | verdict |", "|---|---|---|---|---|"]
    for r in sorted(controls, key=lambda r: (r["control"], r["temperature"])):
        lines.append(f"| {r['control']} | {r['temperature']} | {r['truncation']} | {r['pvalue']:.2e} | {r['verdict']} |")
    text = "\n".join(lines)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    failed = [r for r in rows if r["verdict"] in ("FAIL", "MISSED", "DEGENERATE")]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
