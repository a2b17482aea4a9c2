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

import torch

from verispec.sampling import sample


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
    K = draft_tokens.numel()
    if draft_probs is None:
        draft_probs = one_hot_drafts(draft_tokens, target_probs.shape[-1])
    uniforms = torch.rand(K, generator=generator, dtype=torch.float64)  # [K]
    accept = uniforms < acceptance_probabilities(draft_tokens, draft_probs, target_probs)  # [K]
    rejected = (~accept).nonzero()
    if rejected.numel() == 0:
        return Verdict(K, sample(target_probs[K], generator), bonus=True)
    first = int(rejected[0])
    residual = residual_distribution(target_probs[first], draft_probs[first])
    return Verdict(first, sample(residual.float(), generator), bonus=False)


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


class ExactRule:
    """The exact rule: accept x with probability min(1, p(x)/q(x)), else sample the residual.

    Preserves the target's output distribution exactly.
    """

    name = "exact"
    exact = True

    def verify(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
               generator: torch.Generator) -> Verdict:
        return exact_verify(draft_tokens, draft_probs, target_probs, generator)

    def settings(self) -> dict[str, object]:
        return {"acceptance": self.name}
