"""Acceptance rules: pure functions on tensors that decide which drafted tokens the target keeps.

Vocabulary follows vLLM: **accepted** tokens are drafts the target kept; the **recovered** token is
sampled from the residual distribution at the first rejection; the **bonus** token is sampled from
the target's extra position when every draft is kept. In docs p is the target, q the draft.

Each optimised function has a slow reference beside it (``*_reference``) that the tests compare
against: both consume the generator identically (K uniforms, then one draw), so with equal seeds
they must return equal verdicts.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from verispec.errors import VerispecError
from verispec.sampling import sample, sample_at
from verispec.validation import number, positive_int


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one proposal."""

    num_accepted: int  # drafts kept, a prefix of the proposal
    next_token: int  # the recovered token, or the bonus token when every draft was kept
    bonus: bool


def acceptance_probabilities(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                             target_probs: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) for each drafted x: [K].

    draft_tokens  # [K]
    draft_probs   # [K, vocab]  q, after the sampling transform
    target_probs  # [K(+1), vocab]  p, after the same transform
    q(x) = 0 cannot be drafted by an exact sampler; if it happens (rounding), x is accepted when p(x) > 0.
    """
    index = draft_tokens.view(-1, 1)
    p = target_probs[: draft_tokens.numel()].gather(1, index).squeeze(1).double()  # [K]
    q = draft_probs.gather(1, index).squeeze(1).double()  # [K]
    ratio = torch.where(q > 0, p / q.clamp_min(1e-300), (p > 0).double())
    return ratio.clamp(max=1.0)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) normalised: [vocab]. Where p == q everywhere the residual is empty; then p itself.

    A rejection has probability 0 in that case, so falling back to p never changes the output law;
    it only keeps a rounding accident from producing NaN.
    """
    residual = (target_probs.double() - draft_probs.double()).clamp_min(0)
    total = residual.sum()
    if total <= 0:
        return target_probs.double() / target_probs.double().sum()
    return residual / total


def one_hot_drafts(draft_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q for a deterministic draft: all mass on the drafted token. [K] -> [K, vocab]."""
    return torch.nn.functional.one_hot(draft_tokens, vocab_size).float()


def exact_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                 generator: torch.Generator) -> Verdict:
    """The exact rule (Leviathan et al., Chen et al.): preserves the target's distribution.

    draft_tokens  # [K]
    draft_probs   # [K, vocab], or None for a deterministic draft (then q is one-hot on the draft)
    target_probs  # [K+1, vocab]
    """
    return draw_verdict(ExactRule().law(draft_tokens, draft_probs, target_probs), generator)


@dataclasses.dataclass(frozen=True)
class VerdictLaw:
    """What a rule does with one proposal, as probabilities: the law every verdict is drawn from.

    accept       # [K] float64: P(candidate i kept | candidates before it kept)
    replacement  # i -> [vocab]: the law of the token sampled at the first rejection i, or the bonus (i = K);
                 # computed on demand (sampling needs one row per step)
    Sampling (``draw_verdict``) and exact enumeration (``verispec.divergence``) both read this one law.
    """

    accept: torch.Tensor
    replacement: Callable[[int], torch.Tensor]


def draw_verdict(law: VerdictLaw, generator: torch.Generator) -> Verdict:
    """K uniforms decide the kept prefix; one draw from the row after it gives the next token."""
    K = law.accept.numel()
    uniforms = torch.rand(K, generator=generator, dtype=torch.float64)  # [K]
    rejected = (uniforms >= law.accept).nonzero()
    if rejected.numel() == 0:
        return Verdict(K, sample(law.replacement(K).float(), generator), bonus=True)
    first = int(rejected[0])
    return Verdict(first, sample(law.replacement(first).float(), generator), bonus=False)


def exact_verify_reference(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                           target_probs: torch.Tensor, generator: torch.Generator) -> Verdict:
    """Slow, obviously correct version of ``exact_verify``: one token at a time, as in the paper."""
    K = draft_tokens.numel()
    vocab = target_probs.shape[-1]
    uniforms = torch.rand(K, generator=generator, dtype=torch.float64).tolist()
    for i in range(K):
        x = int(draft_tokens[i])
        q = [0.0] * vocab
        if draft_probs is None:
            q[x] = 1.0
        else:
            q = draft_probs[i].double().tolist()
        p = target_probs[i].double().tolist()
        accept_probability = min(1.0, p[x] / q[x]) if q[x] > 0 else (1.0 if p[x] > 0 else 0.0)
        if uniforms[i] < accept_probability:
            continue
        residual = [max(0.0, pi - qi) for pi, qi in zip(p, q)]
        total = sum(residual)
        residual = [r / total for r in residual] if total > 0 else [pi / sum(p) for pi in p]
        return Verdict(i, sample(torch.tensor(residual, dtype=torch.float32), generator), bonus=False)
    return Verdict(K, sample(target_probs[K], generator), bonus=True)


def coupled_verify(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                   uniform: Callable[[int], float]) -> Verdict:
    """The exact rule for a deterministic draft, with the randomness keyed by output position.

    draft_tokens  # [K]
    target_probs  # [K+1, vocab]
    uniform       # i -> the uniform in [0, 1) of the step's i-th output position (i = 0..K), read lazily
    Position i's token is the one its uniform picks from p_i (``sample_at``): draft i is kept when that
    token is the draft, else that token replaces it. So draft x is kept with probability p(x), as the
    exact rule keeps a one-hot draft (min(1, p(x)/1)), and a rejection's token has law p given "not x",
    which is max(0, p - q) normalised: the same law as ``exact_verify``. And the committed tokens are the
    ones plain sampling with the same uniforms commits, whatever K was: each uniform picks one token, at
    its own position, and is read once.
    """
    drafts = draft_tokens.tolist()
    for i, draft in enumerate(drafts):
        token = sample_at(target_probs[i], uniform(i))
        if token != draft:
            return Verdict(i, token, bonus=False)
    return Verdict(len(drafts), sample_at(target_probs[len(drafts)], uniform(len(drafts))), bonus=True)


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy: keep drafts while they equal the target's argmax; the first mismatch becomes the argmax.

    draft_tokens   # [K]
    target_logits  # [K+1, vocab]
    """
    K = draft_tokens.numel()
    choices = target_logits.argmax(-1)  # [K+1]
    mismatch = (choices[:K] != draft_tokens).nonzero()
    accepted = K if mismatch.numel() == 0 else int(mismatch[0])
    return Verdict(accepted, int(choices[accepted]), bonus=accepted == K)


class AcceptanceRule:
    """Base of the rules: ``law`` says what the rule does; sampling and greedy verification follow from it.

    Under greedy decoding the target's distribution is one-hot on its argmax; approximate rules judge
    the drafts with the target's untempered softmax instead and replace a rejection by the argmax.
    """

    name = "rule"
    exact = False
    # Whether ``verify_coupled`` (position-keyed randomness, deterministic drafts) gives this rule's law
    coupled = False

    def law(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
            target_probs: torch.Tensor) -> VerdictLaw:
        raise NotImplementedError

    def verify(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
               generator: torch.Generator) -> Verdict:
        return draw_verdict(self.law(draft_tokens, draft_probs, target_probs), generator)

    def verify_coupled(self, draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                       uniform: Callable[[int], float]) -> Verdict:
        """Judge a deterministic draft ([K], no q) with one uniform per output position (i -> u_i); only
        for rules whose ``coupled`` is True."""
        raise NotImplementedError

    def keeps(self, draft_tokens: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
        """[K] bool: which drafts a deterministic rule keeps (used for greedy decoding)."""
        raise NotImplementedError

    def verify_greedy(self, draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
        K = draft_tokens.numel()
        keep = self.keeps(draft_tokens, torch.softmax(target_logits.double(), -1)) if K else torch.ones(0, dtype=torch.bool)
        rejected = (~keep).nonzero()
        accepted = K if rejected.numel() == 0 else int(rejected[0])
        return Verdict(accepted, int(target_logits[accepted].argmax()), bonus=accepted == K)

    def parameter(self) -> dict[str, float]:
        return {}

    def settings(self) -> dict[str, object]:
        return {"acceptance": self.label()}

    def label(self) -> str:
        values = ",".join(f"{v:g}" for v in self.parameter().values())
        return f"{self.name}:{values}" if values else self.name


def _drafted(draft_tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """probs[i, x_i] as float64: [K]."""
    return probs[: draft_tokens.numel()].gather(1, draft_tokens.view(-1, 1)).squeeze(1).double()


class ExactRule(AcceptanceRule):
    """The exact rule: accept x with probability min(1, p(x)/q(x)), else sample the residual.

    Preserves the target's output distribution exactly.
    """

    name = "exact"
    exact = True
    coupled = True

    def __init_subclass__(cls, **kwargs) -> None:
        # A subclass changes the law (lenience, forced acceptance, a test's broken rule): it judges with
        # the run's generator through ``law``/``verify`` unless it says itself that coupling serves it.
        super().__init_subclass__(**kwargs)
        if "coupled" not in cls.__dict__:
            cls.coupled = False

    def law(self, draft_tokens, draft_probs, target_probs) -> VerdictLaw:
        K = draft_tokens.numel()
        if draft_probs is None:
            draft_probs = one_hot_drafts(draft_tokens, target_probs.shape[-1])
        replacement = lambda i: (residual_distribution(target_probs[i], draft_probs[i]) if i < K
                                 else target_probs[K].double())
        return VerdictLaw(acceptance_probabilities(draft_tokens, draft_probs, target_probs), replacement)

    def verify_coupled(self, draft_tokens, target_probs, uniform) -> Verdict:
        return coupled_verify(draft_tokens, target_probs, uniform)

    def verify_greedy(self, draft_tokens, target_logits) -> Verdict:
        return greedy_verify(draft_tokens, target_logits)

    def keeps(self, draft_tokens, target_probs) -> torch.Tensor:
        return draft_tokens == target_probs[: draft_tokens.numel()].argmax(-1)


class LenientRule(ExactRule):
    """Leviathan et al.'s lenience l: accept x with probability min(1, p(x) / (l·q(x))), else sample
    max(0, p − l·q) normalised.

    Moves the output distribution toward the draft's as l falls below 1 (l = 1 is the exact rule).
    It is the exact rule run against l·q, so under greedy decoding (p one-hot) it keeps exactly the
    drafts the exact rule keeps.
    """

    name = "lenient"

    def __init__(self, lenience: float) -> None:
        self.lenience = float(number(lenience, "lenience (1 is exact)", 0, 1, low_open=True))
        self.exact = self.lenience == 1.0

    def parameter(self) -> dict[str, float]:
        return {"lenience": self.lenience}

    def law(self, draft_tokens, draft_probs, target_probs) -> VerdictLaw:
        if draft_probs is None:
            draft_probs = one_hot_drafts(draft_tokens, target_probs.shape[-1])
        return super().law(draft_tokens, self.lenience * draft_probs, target_probs)


class _ForcedAcceptanceRule(ExactRule):
    """The exact rule, except that drafts in a set S chosen from p alone are kept outright.

    A draft outside S still faces the exact test min(1, p(x)/q(x)), and a rejection samples the exact
    residual max(0, p − q) normalised. At one position the output law then moves from p by exactly
    the mass forced in: total variation = sum over x in S of max(0, q(x) − p(x)), which can only grow
    as S grows. (Medusa rejects every draft outside S outright; verispec keeps the exact test there,
    which accepts more and loses nothing more.)
    """

    exact = False

    def law(self, draft_tokens, draft_probs, target_probs) -> VerdictLaw:
        exact = super().law(draft_tokens, draft_probs, target_probs)
        keep = self.keeps(draft_tokens, target_probs.double())
        return VerdictLaw(torch.where(keep, torch.ones_like(exact.accept), exact.accept), exact.replacement)

    def verify_greedy(self, draft_tokens, target_logits) -> Verdict:
        return AcceptanceRule.verify_greedy(self, draft_tokens, target_logits)


class TypicalRule(_ForcedAcceptanceRule):
    """Medusa's typical acceptance: keep x outright when p(x) > min(epsilon, delta·exp(−H(p))); any
    other draft faces the exact test, and a rejection samples the exact residual.

    Adds to each position's law the draft's excess mass max(0, q − p) on the target's typical set,
    so the loss grows as epsilon (and delta) fall. delta defaults to sqrt(epsilon), Medusa's pairing.
    Under greedy decoding the set uses the untempered softmax and a rejection takes the argmax.
    """

    name = "typical"

    def __init__(self, epsilon: float, delta: float | None = None) -> None:
        epsilon = number(epsilon, "typical acceptance: epsilon", 0, low_open=True)
        delta = epsilon ** 0.5 if delta is None else number(delta, "typical acceptance: delta", 0, low_open=True)
        self.epsilon, self.delta = float(epsilon), float(delta)

    def parameter(self) -> dict[str, float]:
        return {"epsilon": self.epsilon, "delta": self.delta}

    def keeps(self, draft_tokens, target_probs) -> torch.Tensor:
        probs = target_probs[: draft_tokens.numel()].double()  # [K, vocab]
        entropy = -(probs * probs.clamp_min(1e-300).log()).sum(-1)  # [K]
        threshold = torch.minimum(torch.full_like(entropy, self.epsilon), self.delta * torch.exp(-entropy))
        return _drafted(draft_tokens, probs) > threshold


class TopKRule(_ForcedAcceptanceRule):
    """Top-k membership: keep x outright when it is among the target's k most likely tokens; any other
    draft faces the exact test, and a rejection samples the exact residual.

    Adds to each position's law the draft's excess mass max(0, q − p) on the target's top k, so the
    loss grows with k; under greedy decoding k = 1 is plain greedy verification.
    """

    name = "topk"

    def __init__(self, k: int) -> None:
        self.k = positive_int(k, "top-k membership: k")

    def parameter(self) -> dict[str, float]:
        return {"k": self.k}

    def keeps(self, draft_tokens, target_probs) -> torch.Tensor:
        probs = target_probs[: draft_tokens.numel()].double()  # [K, vocab]
        k = min(self.k, probs.shape[-1])
        kth = probs.topk(k, dim=-1).values[:, -1]  # [K]
        p = _drafted(draft_tokens, probs)
        return (p >= kth) & (p > 0)


RULES = {"exact": ExactRule, "lenient": LenientRule, "typical": TypicalRule, "topk": TopKRule}


def parse_rule(spec: "str | AcceptanceRule | None") -> AcceptanceRule:
    """'exact', 'lenient:0.5', 'typical:0.09' or 'typical:0.09,0.3' (epsilon, delta), 'topk:3'; or a rule."""
    if spec is None:
        return ExactRule()
    if isinstance(spec, AcceptanceRule) or (hasattr(spec, "verify") and hasattr(spec, "settings")):
        return spec  # a rule object (duck-typed rules need verify, settings and exact)
    if not isinstance(spec, str):
        raise VerispecError(f"acceptance must be a rule name like 'lenient:0.5' or a rule object, got {spec!r}")
    name, _, args = spec.strip().partition(":")
    if name not in RULES:
        raise VerispecError(f"unknown acceptance rule '{name}'; choose from {', '.join(RULES)}")
    try:
        values = [float(v) for v in args.split(",")] if args.strip() else []
    except ValueError:
        raise VerispecError(f"acceptance '{spec}': parameters must be numbers") from None
    wanted = {"exact": (0, 0), "lenient": (1, 1), "typical": (1, 2), "topk": (1, 1)}[name]
    if not wanted[0] <= len(values) <= wanted[1]:
        raise VerispecError(f"acceptance '{spec}': {name} takes {wanted[0]}"
                            f"{'-' + str(wanted[1]) if wanted[1] != wanted[0] else ''} parameter(s), "
                            "e.g. exact, lenient:0.5, typical:0.09 (or typical:0.09,0.3), topk:3")
    if name == "topk":
        if values[0] != int(values[0]):
            raise VerispecError(f"top-k membership: k must be an integer >= 1, got {values[0]:g}")
        values = [int(values[0])]
    return RULES[name](*values)
