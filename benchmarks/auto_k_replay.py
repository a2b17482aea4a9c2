"""Replay greedy runs to judge k="auto"'s choices without the machine's timing noise.

In greedy decoding everything a speculative run does is fixed by the text: the target's output is plain
greedy's, and the draft's proposal at each point of it depends only on the committed prefix. So one
recording per prompt (the target's greedy output, and the drafter's K_MAX-candidate proposal with its
confidences at every position) tells how many tokens any K, fixed or chosen per step, would commit in
each step. Pricing those steps with the cost curve the controller measured on this machine gives each
policy's time without the noise of the moment (on a shared machine the same fixed K moves by 10-30%
between runs, more than the differences between policies this is meant to see).

What it does not see: how far the measured curve is from what steps really take (the controller's
"predicted vs achieved"), which only real runs show (``verispec bench``). Modelled speedups here are
labelled as such.

    python benchmarks/auto_k_replay.py benchmarks/configs/pair-auto-qwen15.toml --record results/replay-pair.pt
    python benchmarks/auto_k_replay.py benchmarks/configs/pair-auto-qwen15.toml --record results/replay-pair.pt \
        --set DECAY=0.98   # a controller constant changed for this replay (repeatable)

The recording is made once (a plain greedy run per prompt plus a K_MAX-candidate proposal at every
position: a few minutes for the 0.5B -> 1.5B pair) and reused when the file exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from verispec import adaptive
from verispec.bench.config import load_config
from verispec.bench.engines import Engines
from verispec.bench.runner import _encode
from verispec.drafters.base import DraftContext
from verispec.sampling import SamplingConfig

FIXED = (1, 2, 3, 4, 6, 8)


def record_prompt(model: Any, drafter: Any, ids: list[int], max_new: int, curve: list) -> dict[str, Any]:
    """The target's greedy output and, at every committed length, the drafter's K_MAX proposal with the
    draft's confidence in each candidate (empty for drafters without a distribution)."""
    cache = model.new_cache(len(ids) + max_new + adaptive.K_MAX + 1)
    with torch.inference_mode():
        logits = model.forward(torch.tensor(ids), cache, 0, last_only=True)
        tokens = list(ids) + [int(logits[-1].argmax())]
        context = DraftContext(tokens, model, cache, SamplingConfig(), torch.Generator().manual_seed(0))
        drafter.start(context)
        if not curve:  # the controller's own measurement (or its cache), once per recording
            curve.append(adaptive.cost_curve(model, drafter, context)[0])
        confidences: list[float] = []
        context.keep_drafting = lambda c: confidences.append(c) or True
        proposals, confs, rated = [], [], []  # rated: a proposal's own ratings (Proposal.confidence)
        while len(tokens) - len(ids) < max_new:
            n = len(tokens)
            confidences.clear()
            proposal = drafter.propose(context, adaptive.K_MAX)
            proposals.append(proposal.tokens.tolist())
            confs.append(list(confidences))
            rated.append(list(proposal.confidence or []))
            cache.rollback(n - 1)
            drafter.accepted(0)
            logits = model.forward(torch.tensor([tokens[-1]]), cache, n - 1)
            tokens.append(int(logits[-1].argmax()))
    return {"prompt_len": len(ids), "output": tokens[len(ids):], "proposals": proposals, "confidences": confs,
            "rated": rated}


def replay(rec: dict[str, Any], curve: adaptive.CostCurve, k: int | str, earlier: str | None = None) -> dict[str, Any]:
    """Modelled seconds and steps of one policy (fixed K, or "auto[:mode]") over a recorded prompt;
    ``earlier``: a key under which the policy's runs so far left their learned acceptance (as one bench
    process's runs do: ``AutoK.finish``), None for a run that starts from the prior."""
    out, n0, max_new = rec["output"], rec["prompt_len"], len(rec["output"])
    tokens = [0] * (n0 + 1)  # only its length matters to the controller (the context its rows attend to)
    auto = None
    if adaptive.is_auto(k):
        auto = adaptive.AutoK(adaptive.auto_mode(k))
        auto.curve = dataclasses.replace(curve, verify=list(curve.verify), draft=list(curve.draft))
        auto._tokens = tokens
        if earlier is not None:
            auto._digest = earlier
            auto._start_from_earlier_runs()
    seconds = 0.0
    hist: dict[int, int] = defaultdict(int)
    committed = 1
    accepted_total = 0
    while committed < max_new:
        budget = max_new - committed - 1
        context = len(tokens) - 1
        ask = auto.choose(budget) if auto is not None else min(k, budget)
        proposal = rec["proposals"][committed - 1][:ask]
        proposed = len(proposal)
        if auto is not None and auto.wants_confidence and ask and rec["confidences"][committed - 1]:
            confs = rec["confidences"][committed - 1]
            proposed = 0
            for i in range(len(proposal)):
                proposed = i + 1
                if not auto.keep_drafting(confs[i]):
                    break
        rated = rec.get("rated", [])
        if auto is not None and auto.wants_confidence and ask and rated and rated[committed - 1]:
            proposed = auto.cut(rated[committed - 1][:proposed])  # as the decoding loop does
        accepted = 0
        while accepted < proposed and proposal[accepted] == out[committed + accepted]:
            accepted += 1
        step = accepted + 1
        accepted_total += accepted
        draft = curve.draft[proposed]
        verify = curve.verify_at(proposed + 1, context)
        seconds += draft + verify + curve.overhead
        if auto is not None:
            auto.observe(ask, proposed, accepted, step, draft, verify, curve.overhead)
        hist[ask] += 1
        tokens.extend([0] * step)
        committed += step
    plain_seconds = sum(curve.verify_at(1, n0 + i) + curve.overhead for i in range(max_new - 1))
    result = {"accepted": accepted_total, "seconds": seconds, "plain_seconds": plain_seconds, "speedup": plain_seconds / seconds, "k_histogram": dict(hist)}
    if auto is not None:
        auto.finish()
        report = auto.report()
        result["predicted"] = report["predicted_speedup"]
        result["plain_steps"] = auto.plain_steps
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a verispec bench config (its target, workloads, prompts and methods)")
    ap.add_argument("--record", required=True, help="recording file: made if missing, reused if present")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="change a constant of verispec.adaptive for the replay (e.g. DECAY=0.98)")
    ap.add_argument("--modes", nargs="+", default=["auto"], help="auto modes to replay (auto, auto:cost, ...)")
    ap.add_argument("--refit", action="store_true",
                    help="fit the recorded draft curve as the current code does (adaptive.draft_line)")
    ap.add_argument("--fresh", action="store_true",
                    help="every auto run starts from the prior (default: from what the policy's earlier replayed "
                         "runs learned, in the recorded order, as in one bench process)")
    ap.add_argument("--per-prompt", action="store_true", help="print every prompt's modelled speedups")
    args = ap.parse_args(argv)
    config = load_config(args.config)
    path = Path(args.record)
    if path.exists():
        data = torch.load(path, weights_only=False)
    else:
        torch.set_num_threads(config.threads or torch.get_num_threads())
        engines = Engines(config)
        encoded = _encode(engines, config)
        data = {"methods": {}}
        for setting in config.settings:
            if setting.choice is None or setting.choice.name in data["methods"]:
                continue
            drafter = engines.drafters[setting.label]
            model = engines.targets[setting.quantize]
            curve: list = []
            prompts = []
            began = time.perf_counter()
            for i, (p, ids, _) in enumerate(encoded):
                prompts.append({"workload": p.workload, "id": p.id,
                                **record_prompt(model, drafter, ids, config.max_new_tokens, curve)})
                print(f"[replay] recorded {setting.choice.name} {i + 1}/{len(encoded)} "
                      f"({time.perf_counter() - began:.0f} s)", file=sys.stderr, flush=True)
            data["methods"][setting.choice.name] = {"label": setting.label, "curve": curve[0], "prompts": prompts}
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, path)
    adaptive._read_learned = lambda digest: None  # the replay's learning stays in the replay
    adaptive._write_learned = lambda digest, kept, judged: None
    for assignment in args.set:
        name, value = assignment.split("=", 1)
        setattr(adaptive, name, type(getattr(adaptive, name))(value))
    for name, method in data["methods"].items():
        curve = method["curve"]
        if args.refit:
            curve = dataclasses.replace(curve, draft=adaptive.draft_line(curve.draft))
        policies: list[int | str] = [*FIXED, *args.modes]
        by_workload: dict[str, dict[Any, list[float]]] = defaultdict(lambda: defaultdict(list))
        seconds: dict[Any, float] = defaultdict(float)
        plain_total = 0.0
        predicted, plain_steps, steps = [], 0, 0
        for rec in method["prompts"]:
            row = []
            for policy in policies:
                r = replay(rec, curve, policy, None if args.fresh else f"replay {name} {policy}")
                by_workload[rec["workload"]][policy].append(r["speedup"])
                seconds[policy] += r["seconds"]
                row.append(f"{policy}:{r['speedup']:.2f}")
                if "predicted" in r and policy == args.modes[0]:
                    predicted.append(r["predicted"] / r["speedup"])
                    plain_steps += r["plain_steps"]
                    steps += sum(r["k_histogram"].values())
            plain_total += r["plain_seconds"]
            if args.per_prompt:
                print(rec["workload"], rec["id"], " ".join(row))
        print(f"\n{method['label']}: modelled speedup over plain greedy (median over prompts), "
              f"curve {['%.1f' % (1e3 * v) for v in curve.verify[:9]]} ms verify, "
              f"{['%.1f' % (1e3 * v) for v in curve.draft]} ms draft")
        print("| workload | " + " | ".join(f"K={p}" if isinstance(p, int) else p for p in policies) + " |")
        print("|---|" + "---|" * len(policies))
        for workload, cells in by_workload.items():
            best = max(statistics.median(cells[p]) for p in FIXED)
            print(f"| {workload} | " + " | ".join(
                f"{statistics.median(cells[p]):.3f}" + (" (%+.1f%%)" % (100 * (statistics.median(cells[p]) / best - 1))
                                                         if not isinstance(p, int) else "") for p in policies) + " |")
        every = {p: [v for cells in by_workload.values() for v in cells[p]] for p in policies}
        print("| all (median) | " + " | ".join(f"{statistics.median(every[p]):.3f}" for p in policies) + " |")
        print("| all (total time) | " + " | ".join(f"{plain_total / seconds[p]:.3f}" for p in policies) + " |")
        print(f"{args.modes[0]}: plain steps {plain_steps} of {steps}; predicted/modelled median "
              f"{statistics.median(predicted):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
