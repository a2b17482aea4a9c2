"""Self-speculative drafters: a cheaper pass of the target itself drafts, the full model verifies.

Three different approximations, each its own drafter: ``LayerSkip`` omits layers (or their attention
or MLP sub-blocks), ``EarlyExit`` stops at an intermediate layer and reuses that work during
verification, ``LowRank`` swaps weight matrices for truncated-SVD factors. All share the target's KV
cache: draft passes write only positions that verification then overwrites, so the committed prefix
always holds full-model KV.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from verispec.drafters.base import DraftContext, Proposal, draft_token, validate_k
from verispec.errors import VerispecError
from verispec.models.transformer import LayerStep


DEFAULT_K = 4


def require_native(model: Any, method: str) -> None:
    if not hasattr(model, "run_layers"):
        raise VerispecError(f"{method} drafts from the target's own layers and needs the native backend "
                            "(backend='native'); the hf backend cannot run part of a model")


class SelfDrafter:
    """Shared autoregressive loop: subclasses say how one cheap pass turns a token into logits."""

    method = "self"

    def __init__(self, k: int) -> None:
        self.k = validate_k(k)

    def start(self, context: DraftContext) -> None:
        require_native(context.target, self.method)
        self.check(context.target)

    def check(self, model: Any) -> None:
        """Validate the drafter's parameters against the model."""

    def draft_logits(self, model: Any, cache: Any, token: int, position: int) -> torch.Tensor:
        """Logits [vocab] of the cheap pass over ``token`` at ``position``."""
        raise NotImplementedError

    def begin_proposal(self) -> None:
        """Reset per-proposal state."""

    def propose(self, context: DraftContext, k: int) -> Proposal:
        self.begin_proposal()
        model, cache, sampling = context.target, context.cache, context.sampling
        token, position = context.tokens[-1], len(context.tokens) - 1
        tokens, probs = [], []
        with torch.inference_mode():
            for i in range(k):
                logits = self.draft_logits(model, cache, token, position + i)
                token, q = draft_token(logits, sampling, context.generator)
                if q is not None:
                    probs.append(q)
                tokens.append(token)
        return Proposal(torch.tensor(tokens), torch.stack(probs) if probs else None, draft_calls=k,
                        reuse=self.reuse_state())

    def reuse_state(self) -> Any:
        return None

    def accepted(self, num_accepted: int) -> None:
        pass  # the shared cache is rolled back by the decoder


# ------------------------------------------------------------------------------------------ layer skip

def _indices(values: Iterable[int] | None, num_layers: int, what: str) -> tuple[int, ...]:
    out = tuple(sorted(set(int(v) for v in (values or ()))))
    bad = [v for v in out if not 0 <= v < num_layers] if num_layers else []
    if bad:
        raise VerispecError(f"{what}: layer indices {bad} are outside 0..{num_layers - 1}")
    return out


class LayerSkip(SelfDrafter):
    """Draft by omitting chosen layers: whole layers (``skip``), or only their attention
    (``skip_attention``) or MLP (``skip_mlp``) sub-block, as Draft & Verify does.

    ``skip`` may also be the path of a JSON file written by ``verispec tune layer-skip``.
    """

    method = "layer-skip"

    def __init__(self, skip: Sequence[int] | str | Path = (), k: int | None = None,
                 skip_attention: Sequence[int] = (), skip_mlp: Sequence[int] = ()) -> None:
        if isinstance(skip, (str, Path)):  # an explicit k wins over the file's
            spec = load_tuned(skip, self.method)
            skip, skip_attention, skip_mlp = spec.get("skip", ()), spec.get("skip_attention", ()), spec.get("skip_mlp", ())
            k = spec.get("k") if k is None else k
        super().__init__(DEFAULT_K if k is None else k)
        self.skip = _indices(skip, 0, "skip")
        self.skip_attention = _indices(skip_attention, 0, "skip_attention")
        self.skip_mlp = _indices(skip_mlp, 0, "skip_mlp")
        if not (self.skip or self.skip_attention or self.skip_mlp):
            raise VerispecError("LayerSkip needs at least one layer or sub-block to skip")

    def settings(self) -> dict[str, Any]:
        return {"method": self.method, "k": self.k, "skip": list(self.skip),
                "skip_attention": list(self.skip_attention), "skip_mlp": list(self.skip_mlp)}

    def check(self, model: Any) -> None:
        n = model.config.num_layers
        for name in ("skip", "skip_attention", "skip_mlp"):
            _indices(getattr(self, name), n, name)
        self.steps = draft_steps(n, self.skip, self.skip_attention, self.skip_mlp)
        if not self.steps:
            raise VerispecError("LayerSkip would skip every layer")

    def draft_logits(self, model: Any, cache: Any, token: int, position: int) -> torch.Tensor:
        hidden = model.run_layers(model.embed_tokens(torch.tensor([token])), cache, position, self.steps)
        return model.logits(hidden)[-1]


def draft_steps(num_layers: int, skip: Iterable[int], skip_attention: Iterable[int] = (),
                skip_mlp: Iterable[int] = ()) -> list[LayerStep]:
    skip, attn, mlp = set(skip), set(skip_attention), set(skip_mlp)
    steps = [LayerStep(i, attention=i not in attn, mlp=i not in mlp) for i in range(num_layers) if i not in skip]
    return [s for s in steps if s.attention or s.mlp]


def load_tuned(path: str | Path, method: str) -> dict[str, Any]:
    path = Path(path)
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise VerispecError(f"cannot read the {method} settings file {path}: {exc}") from None
    if spec.get("method") != method:
        raise VerispecError(f"{path} holds settings for '{spec.get('method')}', not '{method}'")
    return spec


# ------------------------------------------------------------------------------------------ early exit

class EarlyExit(SelfDrafter):
    """Draft with layers 0..E-1 then the final norm and LM head.

    The first E layers are the same in draft and full passes, so verification reuses them: the
    draft's KV for layers < E stays in the shared cache, and verification runs only layers >= E on
    the hidden states the draft saved at layer E (LayerSkip's cache reuse). Only the last candidate,
    which the draft never fed, goes through layers < E during verification.
    """

    method = "early-exit"

    def __init__(self, layer: int | str | Path, k: int | None = None) -> None:
        if isinstance(layer, (str, Path)):  # an explicit k wins over the file's
            spec = load_tuned(layer, self.method)
            layer, k = spec.get("layer"), spec.get("k") if k is None else k
        k = DEFAULT_K if k is None else k
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 1:
            raise VerispecError(f"early-exit layer must be an integer >= 1, got {layer!r}")
        super().__init__(k)
        self.layer = layer
        self.saved: list[torch.Tensor] = []

    def settings(self) -> dict[str, Any]:
        return {"method": self.method, "k": self.k, "exit_layer": self.layer}

    def check(self, model: Any) -> None:
        n = model.config.num_layers
        if self.layer >= n:
            raise VerispecError(f"exit layer {self.layer} must be below the model's {n} layers")
        self.first = [LayerStep(i) for i in range(self.layer)]
        self.rest = [LayerStep(i) for i in range(self.layer, n)]

    def begin_proposal(self) -> None:
        self.saved = []

    def draft_logits(self, model: Any, cache: Any, token: int, position: int) -> torch.Tensor:
        hidden = model.run_layers(model.embed_tokens(torch.tensor([token])), cache, position, self.first)
        self.saved.append(hidden)  # [1, 1, hidden] at layer E
        return model.logits(hidden)[-1]

    def reuse_state(self) -> Any:
        return self.saved

    def verify_logits(self, context: DraftContext, inputs: torch.Tensor, proposal: Proposal) -> torch.Tensor:
        """Target logits [K+1, vocab] for ``inputs`` at positions n-1.. using the saved layer-E states."""
        model, cache = context.target, context.cache
        start = len(context.tokens) - 1
        last = start + inputs.numel() - 1
        with torch.inference_mode():
            tail = model.run_layers(model.embed_tokens(inputs[-1:]), cache, last, self.first)  # [1, 1, hidden]
            hidden = torch.cat(self.saved[: inputs.numel() - 1] + [tail], dim=1)  # [1, K+1, hidden]
            hidden = model.run_layers(hidden, cache, start, self.rest)
            cache.length = last + 1
            return model.logits(hidden)
