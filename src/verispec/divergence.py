"""Exact output laws by enumeration: how far an acceptance rule moves the output distribution.

For a tiny vocabulary the law of the first few generated tokens can be written down exactly, both
for plain sampling from the target and for speculative decoding with a draft model under any
acceptance rule: every draft sequence is enumerated with its probability under q, and the rule's
``VerdictLaw`` (the same object sampling draws from) gives the probability of every outcome. The
enumeration mirrors ``verispec.decoding``: the prefill gives the first token from p; each later step
drafts min(K, tokens still wanted - 1) candidates.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from verispec.acceptance import AcceptanceRule

Law = dict[tuple[int, ...], float]
NextProbs = Callable[[tuple[int, ...]], torch.Tensor]  # generated prefix -> [vocab] probabilities (after the sampling transform)


def target_law(p: NextProbs, length: int) -> Law:
    """P(x1..xL) under plain sampling from p."""
    law: Law = {(): 1.0}
    for _ in range(length):
        grown: Law = {}
        for prefix, mass in law.items():
            for token, prob in enumerate(p(prefix).double().tolist()):
                if prob > 0:
                    grown[prefix + (token,)] = mass * prob
        law = grown
    return law


def _draft_sequences(q: NextProbs, prefix: tuple[int, ...], k: int):
    """Every k-token draft continuing ``prefix`` with its probability and its q rows: (tokens, prob, [k, vocab])."""
    frontier = [((), 1.0, [])]
    for _ in range(k):
        grown = []
        for drafted, mass, rows in frontier:
            probs = q(prefix + drafted).double()
            for token, prob in enumerate(probs.tolist()):
                if prob > 0:
                    grown.append((drafted + (token,), mass * prob, rows + [probs]))
        frontier = grown
    return frontier


def speculative_law(p: NextProbs, q: NextProbs, rule: AcceptanceRule, k: int, length: int) -> Law:
    """P(x1..xL) under speculative sampling with draft law q, candidate length k and ``rule``."""
    law: Law = {}
    first = p(()).double()
    pending = [((token,), prob) for token, prob in enumerate(first.tolist()) if prob > 0]
    while pending:
        prefix, mass = pending.pop()
        if len(prefix) >= length:
            key = prefix[:length]
            law[key] = law.get(key, 0.0) + mass
            continue
        steps = min(k, length - len(prefix) - 1)
        for drafted, draft_mass, q_rows in _draft_sequences(q, prefix, steps):
            tokens = torch.tensor(drafted, dtype=torch.long)
            p_rows = torch.stack([p(prefix + drafted[:i]) for i in range(steps + 1)])  # [steps+1, vocab]
            verdict = rule.law(tokens, torch.stack(q_rows) if q_rows else None, p_rows)
            kept = 1.0
            for i in range(steps + 1):
                stop = 1.0 - float(verdict.accept[i]) if i < steps else 1.0  # reject at i, or the bonus
                outcome = mass * draft_mass * kept * stop
                if outcome > 0:
                    for token, prob in enumerate(verdict.replacement(i).tolist()):
                        if prob > 0:
                            pending.append((prefix + drafted[:i] + (token,), outcome * prob))
                if i < steps:
                    kept *= float(verdict.accept[i])
                    if kept == 0:
                        break
    return law


def total_variation(a: Law, b: Law) -> float:
    return 0.5 * sum(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b))


def kl_divergence(method: Law, target: Law) -> float:
    """KL(method || target) in nats; infinite if the method puts mass where the target has none."""
    total = 0.0
    for seq, m in method.items():
        if m <= 0:
            continue
        t = target.get(seq, 0.0)
        if t <= 0:
            return math.inf
        total += m * math.log(m / t)
    return max(total, 0.0)


def memoised(fn: Callable[[tuple[int, ...]], torch.Tensor]) -> NextProbs:
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def wrapped(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in cache:
            cache[prefix] = fn(prefix)
        return cache[prefix]

    return wrapped


def model_next_probs(model, prompt: Sequence[int], sampling) -> NextProbs:
    """p(· | prompt + prefix) from a fresh forward pass of ``model``, after the sampling transform."""
    from verispec.sampling import logits_to_probs

    def next_probs(prefix: tuple[int, ...]) -> torch.Tensor:
        ids = torch.tensor(list(prompt) + list(prefix))
        with torch.inference_mode():
            logits = model.forward(ids, model.new_cache(ids.numel() + 1), 0, last_only=True)[-1]
        return logits_to_probs(logits, sampling).double()

    return memoised(next_probs)


def divergence_table(p: NextProbs, q: NextProbs, rules: Sequence[AcceptanceRule], k: int,
                     length: int) -> list[dict[str, object]]:
    """TV and KL(method || target) of each rule's law of the first ``length`` tokens."""
    reference = target_law(p, length)
    rows = []
    for rule in rules:
        law = speculative_law(p, q, rule, k, length)
        rows.append({"rule": rule.label(), "exact": rule.exact, "tv": total_variation(law, reference),
                     "kl": kl_divergence(law, reference), "mass": sum(law.values())})
    return rows


__all__ = ["divergence_table", "kl_divergence", "model_next_probs", "speculative_law", "target_law",
           "total_variation"]
