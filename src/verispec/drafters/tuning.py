"""Choosing self-speculative settings: which layers to skip, where to exit.

Method (cheap and sound, in the spirit of SWIFT's on-the-fly search rather than Draft & Verify's
Bayesian optimisation): on a few calibration prompts the full model first decodes greedily; then one
teacher-forced pass of a candidate draft over those tokens gives its greedy acceptance proxy alpha
(how often its argmax equals the target's). With the draft's cost c per token relative to a full step
(weight bytes it reads) and the measured cost v of verifying K+1 tokens relative to one step, the
expected speedup is E[tokens per step] / (K c + v), with E = (1 - alpha^(K+1)) / (1 - alpha)
(i.i.d. acceptance, as in Leviathan et al.). Layer skipping ranks attention and MLP sub-blocks by how
little skipping each alone lowers alpha, then scores skipping the m least important for growing m;
early exit scores every exit layer from one pass. The chosen setting is then timed for real against plain decoding.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from verispec.decoding import encode_prompt, generate
from verispec.drafters.registry import make_choice
from verispec.drafters.self_speculative import draft_steps, require_native
from verispec.errors import VerispecError
from verispec.models.protocol import LayeredModel

log = logging.getLogger(__name__)

CALIBRATION_PROMPTS = [
    "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
    "Explain in two short paragraphs why the sky is blue.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "import json\n\ndef load_config(path):\n",
]


@dataclasses.dataclass
class Calibration:
    sequences: list[torch.Tensor]  # prompt + greedy continuation, [T] each
    starts: list[int]  # where the continuation begins in each
    target_choices: list[torch.Tensor]  # the full model's argmax at each continuation position
    verify_cost: dict[int, float]  # K -> time(verify K+1 tokens) / time(one decode step)
    full_pass_seconds: float  # one single-token pass through every layer and the head

    def draft_cost(self, model: LayeredModel, steps: list) -> float:
        """Measured time of a draft pass over that of a full pass (bytes alone miss per-layer overhead)."""
        return _pass_seconds(model, steps) / self.full_pass_seconds


def calibrate(model: LayeredModel, prompts: list[str], new_tokens: int, ks: Iterable[int]) -> Calibration:
    require_native(model, "tuning")
    sequences, starts, choices = [], [], []
    for prompt in prompts:
        ids = encode_prompt(model, prompt) if isinstance(prompt, str) else list(prompt)
        out = generate(model, input_ids=ids, max_new_tokens=new_tokens, ignore_eos=True).token_ids
        seq = torch.tensor(ids + out)
        logits = model.forward(seq, model.new_cache(seq.numel()), 0)
        sequences.append(seq)
        starts.append(len(ids) - 1)  # the logits at len(ids)-1 predict the first continuation token
        choices.append(logits[len(ids) - 1: -1].argmax(-1))
    return Calibration(sequences, starts, choices, {k: measure_verify_cost(model, k) for k in ks},
                       _pass_seconds(model, model.all_layers))


def measure_verify_cost(model: LayeredModel, k: int, repeats: int = 5) -> float:
    """Median time of one target pass over K+1 tokens over that of one token, on a 128-token cache."""
    cache = model.new_cache(128 + k + 1)
    model.forward(torch.arange(128) % model.config.vocab_size, cache, 0)
    times = {}
    for width in (1, k + 1):
        samples = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            model.forward(torch.arange(width), cache, 128)
            samples.append(time.perf_counter() - start)
        times[width] = statistics.median(samples[1:])
    return times[k + 1] / times[1]


def _pass_seconds(model: LayeredModel, steps: list, repeats: int = 5) -> float:
    """Median time of one single-token pass through ``steps`` and the LM head, on a 64-token cache."""
    cache = model.new_cache(65)
    model.forward(torch.arange(64) % model.config.vocab_size, cache, 0)
    samples = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            model.logits(model.run_layers(model.embed_tokens(torch.tensor([1])), cache, 64, steps))
            samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


def match_rate(model: LayeredModel, calibration: Calibration, steps: list) -> float:
    """Greedy acceptance proxy: how often the draft pass's argmax equals the full model's."""
    hits = total = 0
    with torch.inference_mode():
        for seq, start, choices in zip(calibration.sequences, calibration.starts, calibration.target_choices):
            hidden = model.run_layers(model.embed_tokens(seq), model.new_cache(seq.numel()), 0, steps)
            draft = model.logits(hidden)[start:-1].argmax(-1)
            hits += int((draft == choices).sum())
            total += choices.numel()
    return hits / total


def expected_speedup(alpha: float, k: int, cost: float, verify_cost: float) -> float:
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * cost + verify_cost)


def best_k(alpha: float, cost: float, calibration: Calibration) -> tuple[int, float]:
    return max(((k, expected_speedup(alpha, k, cost, v)) for k, v in calibration.verify_cost.items()),
               key=lambda kv: kv[1])


def tune_layer_skip(model: LayeredModel, calibration: Calibration, progress: Callable[[str], None] = log.info,
                    max_skipped: int | None = None) -> dict[str, Any]:
    """Rank sub-blocks by how little skipping each alone hurts, then try skipping the m least important.

    2L teacher-forced passes score the units one by one; up to ``max_skipped`` more score the nested
    sets. Adding units one at a time by the estimate alone stalls: one skipped sub-block saves too
    little to pay for the acceptance it costs, while a dozen can.
    """
    n = model.config.num_layers
    units = [(i, part) for i in range(n) for part in ("attention", "mlp")]
    scores = []
    for done, unit in enumerate(units, 1):
        scores.append((match_rate(model, calibration, _steps_from_units(n, {unit})), unit))
        if done % 10 == 0 or done == len(units):
            progress(f"scored {done}/{len(units)} sub-blocks")
    order = [unit for _, unit in sorted(scores, key=lambda su: (-su[0], -su[1][0]))]
    best = None
    for m in range(1, (max_skipped or len(units) - 1) + 1):
        chosen = set(order[:m])
        steps = _steps_from_units(n, chosen)
        if not steps:
            break
        alpha, cost = match_rate(model, calibration, steps), calibration.draft_cost(model, steps)
        k, speedup = best_k(alpha, cost, calibration)
        if best is None or speedup > best["speedup"]:
            best = {"units": chosen, "alpha": alpha, "cost": cost, "k": k, "speedup": speedup}
        progress(f"skip {m} sub-blocks: alpha {alpha:.2f}, draft cost {cost:.2f}, K={k}, "
                 f"estimated speedup {speedup:.2f}x (best {best['speedup']:.2f}x)")
        if alpha < 0.2:  # acceptance has collapsed; more skipping only gets worse
            break
    if best["speedup"] < 1:
        progress("warning: no skip set is estimated to beat plain decoding on these prompts")
    attention = {i for i, part in best["units"] if part == "attention"}
    mlp = {i for i, part in best["units"] if part == "mlp"}
    whole = sorted(attention & mlp)
    return {"method": "layer-skip", "skip": whole, "skip_attention": sorted(attention - set(whole)),
            "skip_mlp": sorted(mlp - set(whole)), "k": best["k"],
            "estimate": {"alpha": best["alpha"], "draft_cost": best["cost"], "speedup": best["speedup"]}}


def _steps_from_units(n: int, units: set[tuple[int, str]]) -> list:
    attention = {i for i, part in units if part == "attention"}
    mlp = {i for i, part in units if part == "mlp"}
    return draft_steps(n, attention & mlp, attention, mlp)


def tune_early_exit(model: LayeredModel, calibration: Calibration, progress: Callable[[str], None] = log.info) -> dict[str, Any]:
    """Score every exit layer from one pass per calibration sequence."""
    n = model.config.num_layers
    hits = [0] * n
    total = 0
    with torch.inference_mode():
        for seq, start, choices in zip(calibration.sequences, calibration.starts, calibration.target_choices):
            cache = model.new_cache(seq.numel())
            hidden = model.embed_tokens(seq)
            for layer in range(1, n):
                hidden = model.run_layers(hidden, cache, 0, [draft_steps(n, ())[layer - 1]])
                hits[layer] += int((model.logits(hidden)[start:-1].argmax(-1) == choices).sum())
            total += choices.numel()
    scored = []
    for layer in range(1, n):
        alpha = hits[layer] / total
        cost = calibration.draft_cost(model, draft_steps(n, range(layer, n)))
        k, speedup = best_k(alpha, cost, calibration)
        scored.append({"layer": layer, "alpha": alpha, "cost": cost, "k": k, "speedup": speedup})
        progress(f"exit at layer {layer}: alpha {alpha:.2f}, draft cost {cost:.2f}, K={k}, "
                 f"estimated speedup {speedup:.2f}x")
    best = max(scored, key=lambda s: s["speedup"])
    if best["speedup"] < 1:
        progress("warning: no exit layer is estimated to beat plain decoding on these prompts")
    return {"method": "early-exit", "layer": best["layer"], "k": best["k"],
            "estimate": {"alpha": best["alpha"], "draft_cost": best["cost"], "speedup": best["speedup"]},
            "all_layers": scored}


def measure_speedup(model: LayeredModel, drafter: Any, prompts: list[str], new_tokens: int) -> dict[str, float]:
    """Real greedy runs, plain and speculative alternating per prompt: median speedup and acceptance."""
    ratios, accepted, drafted = [], 0, 0
    for prompt in prompts:
        ids = encode_prompt(model, prompt) if isinstance(prompt, str) else list(prompt)
        plain = generate(model, input_ids=ids, max_new_tokens=new_tokens, ignore_eos=True)
        spec = generate(model, input_ids=ids, max_new_tokens=new_tokens, ignore_eos=True, drafter=drafter)
        ratios.append(spec.stats.tokens_per_second / plain.stats.tokens_per_second)
        accepted += spec.stats.accepted_tokens
        drafted += spec.stats.drafted_tokens
    return {"speedup": statistics.median(ratios), "acceptance": accepted / drafted if drafted else 0.0}


def tune(method: str, model: LayeredModel, prompts: list[str] | None = None, new_tokens: int = 32,
         ks: Iterable[int] = (1, 2, 3, 4, 6, 8), progress: Callable[[str], None] = log.info,
         max_skipped: int | None = None) -> dict[str, Any]:
    prompts = prompts or CALIBRATION_PROMPTS[:2]
    progress(f"calibrating on {len(prompts)} prompts ({new_tokens} greedy tokens each)")
    calibration = calibrate(model, prompts, new_tokens, ks)
    progress("verification cost relative to one step: " +
             ", ".join(f"K={k}: {v:.2f}" for k, v in calibration.verify_cost.items()))
    if method == "layer-skip":
        spec = tune_layer_skip(model, calibration, progress, max_skipped)
        choice = make_choice(method, {key: spec[key] for key in ("skip", "skip_attention", "skip_mlp")}, spec["k"])
    elif method == "early-exit":
        spec = tune_early_exit(model, calibration, progress)
        choice = make_choice(method, {"layer": spec["layer"]}, spec["k"])
    else:
        raise VerispecError(f"unknown tuning method '{method}'; use layer-skip or early-exit")
    drafter = choice.build()
    progress("timing the chosen setting against plain decoding")
    spec["measured"] = measure_speedup(model, drafter, prompts, new_tokens)
    spec["model"] = model.name
    spec["dtype"] = str(model.dtype).removeprefix("torch.")
    spec["search"] = __doc__.split("\n\n")[1].replace("\n", " ")
    progress(f"chosen: {drafter.settings()}; measured speedup {spec['measured']['speedup']:.2f}x, "
             f"acceptance {spec['measured']['acceptance']:.0%}")
    return spec


def write_settings(spec: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=2))
    return path
