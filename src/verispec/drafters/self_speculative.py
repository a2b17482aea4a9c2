"""Self-speculative drafters: a cheaper pass of the target itself drafts, the full model verifies.

Three different approximations, each its own drafter: ``LayerSkip`` omits layers (or their attention
or MLP sub-blocks), ``EarlyExit`` stops at an intermediate layer and reuses that work during
verification, ``LowRank`` swaps weight matrices for truncated-SVD factors. All share the target's KV
cache: draft passes write only positions that verification then overwrites, so the committed prefix
always holds full-model KV.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from verispec.drafters.base import DEFAULT_K, DraftContext, DrafterBase, Proposal, draft_token, stop_drafting
from verispec.drafters.registry import DrafterSpec, Param, read_tuned
from verispec.errors import VerispecError
from verispec.models.protocol import LayeredModel
from verispec.models.transformer import LayerStep
from verispec.validation import integer, positive_int


def require_native(model: Any, method: str) -> LayeredModel:
    if not isinstance(model, LayeredModel):
        raise VerispecError(f"{method} drafts from the target's own layers and needs the native backend "
                            "(backend='native'); the hf backend cannot run part of a model")
    return model


class SelfDrafter(DrafterBase):
    """Shared autoregressive loop: subclasses say how one cheap pass turns a token into logits.

    What a drafter derives from the target (layer plans, factors) is kept per target, so one drafter
    object can serve several targets, even interleaved.
    """

    method = "self"

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self._plans: dict[int, tuple[Any, Any]] = {}  # id(target) -> (target, its plan)

    def start(self, context: DraftContext) -> None:
        self.plan_for(require_native(context.target, self.method))

    def plan_for(self, model: LayeredModel) -> Any:
        """What ``check`` derived for this target, computed once per target."""
        entry = self._plans.get(id(model))
        if entry is None or entry[0] is not model:  # the entry holds the target, so its id stays unique
            entry = self._plans[id(model)] = (model, self.check(model))
        return entry[1]

    def check(self, model: LayeredModel) -> Any:
        """Validate the drafter's parameters against the model; return the plan its passes need."""

    def draft_logits(self, model: Any, cache: Any, token: int, position: int, plan: Any) -> torch.Tensor:
        """Logits [vocab] of the cheap pass over ``token`` at ``position``."""
        raise NotImplementedError

    def begin_proposal(self) -> None:
        """Reset per-proposal state."""

    def propose(self, context: DraftContext, k: int) -> Proposal:
        self.begin_proposal()
        model, cache, sampling = context.target, context.cache, context.sampling
        plan = self.plan_for(model)
        token, position = context.tokens[-1], len(context.tokens) - 1
        tokens, probs = [], []
        with torch.inference_mode():
            for i in range(k):
                logits = self.draft_logits(model, cache, token, position + i, plan)
                token, q = draft_token(logits, sampling, context.generator)
                if q is not None:
                    probs.append(q)
                tokens.append(token)
                if stop_drafting(context, logits, token, q):
                    break
        return Proposal(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None,
                        draft_calls=len(tokens))


class LayerProjections:
    """A layer's four products (qkv, o, gate_up, down) as a draft pass runs them: each the original
    matrix or a cheaper stand-in (low-rank factors, quantized weights)."""

    def __init__(self, **products: Any) -> None:
        self.__dict__.update(products)


class SwappedMatrices(SelfDrafter):
    """A draft pass through every layer with some matrices swapped: ``check`` returns a plan with
    ``projections`` (one ``LayerProjections`` per layer) and ``head`` (None keeps the LM head)."""

    def draft_logits(self, model: Any, cache: Any, token: int, position: int, plan: Any) -> torch.Tensor:
        hidden = model.run_layers(model.embed_tokens(torch.tensor([token])), cache, position, model.all_layers,
                                  projections=plan.projections)
        return model.logits(hidden, head=plan.head)[-1]


# ------------------------------------------------------------------------------------------ layer skip

def _indices(values: Iterable[int] | None, num_layers: int, what: str) -> tuple[int, ...]:
    values = () if values is None else values
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise VerispecError(f"{what} must be a list of layer indices, got {values!r}")
    out = tuple(sorted(set(integer(v, f"{what}: a layer index", minimum=0) for v in values)))
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

    def __init__(self, skip: Sequence[int] | str | Path = (), k: int | str | None = None,
                 skip_attention: Sequence[int] = (), skip_mlp: Sequence[int] = ()) -> None:
        if isinstance(skip, (str, Path)):  # an explicit k wins over the file's
            spec = read_tuned(skip, self.method)
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

    def check(self, model: LayeredModel) -> list[LayerStep]:
        n = model.config.num_layers
        for name in ("skip", "skip_attention", "skip_mlp"):
            _indices(getattr(self, name), n, name)
        steps = draft_steps(n, self.skip, self.skip_attention, self.skip_mlp)
        if not steps:
            raise VerispecError("LayerSkip would skip every layer")
        return steps

    def draft_logits(self, model: Any, cache: Any, token: int, position: int, plan: list[LayerStep]) -> torch.Tensor:
        hidden = model.run_layers(model.embed_tokens(torch.tensor([token])), cache, position, plan)
        return model.logits(hidden)[-1]


def draft_steps(num_layers: int, skip: Iterable[int], skip_attention: Iterable[int] = (),
                skip_mlp: Iterable[int] = ()) -> list[LayerStep]:
    skip, attn, mlp = set(skip), set(skip_attention), set(skip_mlp)
    steps = [LayerStep(i, attention=i not in attn, mlp=i not in mlp) for i in range(num_layers) if i not in skip]
    return [s for s in steps if s.attention or s.mlp]


# ------------------------------------------------------------------------------------------ early exit

class EarlyExit(SelfDrafter):
    """Draft with layers 0..E-1 then the final norm and LM head.

    The first E layers are the same in draft and full passes, so verification reuses them: the
    draft's KV for layers < E stays in the shared cache, and verification runs only layers >= E on
    the hidden states the draft saved at layer E (LayerSkip's cache reuse). Only the last candidate,
    which the draft never fed, goes through layers < E during verification.
    """

    method = "early-exit"

    def __init__(self, layer: int | str | Path, k: int | str | None = None) -> None:
        if isinstance(layer, (str, Path)):  # an explicit k wins over the file's
            spec = read_tuned(layer, self.method)
            layer, k = spec.get("layer"), spec.get("k") if k is None else k
        super().__init__(DEFAULT_K if k is None else k)
        self.layer = positive_int(layer, "early-exit layer")
        self.saved: list[torch.Tensor] = []

    def settings(self) -> dict[str, Any]:
        return {"method": self.method, "k": self.k, "exit_layer": self.layer}

    def check(self, model: LayeredModel) -> tuple[list[LayerStep], list[LayerStep]]:
        n = model.config.num_layers
        if self.layer >= n:
            raise VerispecError(f"exit layer {self.layer} must be below the model's {n} layers")
        return [LayerStep(i) for i in range(self.layer)], [LayerStep(i) for i in range(self.layer, n)]

    def begin_proposal(self) -> None:
        self.saved = []

    def draft_logits(self, model: Any, cache: Any, token: int, position: int, plan: Any) -> torch.Tensor:
        first, _ = plan
        hidden = model.run_layers(model.embed_tokens(torch.tensor([token])), cache, position, first)
        self.saved.append(hidden)  # [1, 1, hidden] at layer E
        return model.logits(hidden)[-1]

    def target_logits(self, context: DraftContext, inputs: torch.Tensor) -> torch.Tensor:
        """Target logits [K+1, vocab] for ``inputs`` at positions n-1.. using the saved layer-E states."""
        model, cache = context.target, context.cache
        first, rest = self.plan_for(model)
        start = len(context.tokens) - 1
        drafted = inputs.numel() - 1  # positions the draft ran through layers < E (all but the last candidate)
        if drafted == 0 or len(self.saved) < drafted:  # nothing of this proposal to reuse
            return model.forward(inputs, cache, start)
        with torch.inference_mode():
            tail = model.run_layers(model.embed_tokens(inputs[-1:]), cache, start + drafted, first)  # [1, 1, hidden]
            hidden = torch.cat(self.saved[:drafted] + [tail], dim=1)  # [1, K+1, hidden] at layer E
            return model.forward_hidden(hidden, cache, start, rest)  # [K+1, vocab]


def _describe_skip(p: dict[str, Any], target: str) -> str:
    skip = p.get("skip", [])
    if isinstance(skip, str):
        return f"{target} skipping the sub-blocks {Path(skip).name} names"
    parts = [f"layers {skip}" if skip else "", f"attention of {p['skip_attention']}" if p.get("skip_attention") else "",
             f"MLP of {p['skip_mlp']}" if p.get("skip_mlp") else ""]
    return f"{target} skipping " + ", ".join(x for x in parts if x)


LAYER_SKIP = DrafterSpec(
    name="layer-skip", summary="the target with whole layers, or their attention / MLP sub-blocks, omitted",
    params=(
        Param("skip", "ints|file", "Self-speculative: skip layers in the draft pass (JSON from `verispec tune "
              "layer-skip`, or 3,5,7).", flag="--layer-skip", selects=True),
        Param("skip_attention", "ints", "Layers whose attention sub-block the draft skips."),
        Param("skip_mlp", "ints", "Layers whose MLP sub-block the draft skips."),
    ),
    build=lambda p, k, load: LayerSkip(p.get("skip", ()), k=k, skip_attention=p.get("skip_attention", ()),
                                       skip_mlp=p.get("skip_mlp", ())),
    describe=_describe_skip,
)

EARLY_EXIT = DrafterSpec(
    name="early-exit", summary="the target's first E layers, then its norm and head; verification reuses them",
    params=(Param("layer", "int|file", "Self-speculative: draft with the first E layers (E, or JSON from "
                  "`verispec tune early-exit`).", required=True, flag="--early-exit", selects=True),),
    build=lambda p, k, load: EarlyExit(p["layer"], k=k),
    describe=lambda p, target: f"{target} exiting at layer {p['layer']}",
)
