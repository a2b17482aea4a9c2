"""``k="auto"``: choose the candidate length K at every step from costs measured on this machine.

At the start of a run the controller measures (or reads from its cache) what a step costs here: the
target's verification pass over M = 1..16 positions, and the drafter's cost for 0..K_MAX candidates
(through the drafter's own ``propose`` and ``target_logits``, so early exit's cheaper verification and
a draft model's catch-up are what is measured). During the run it keeps, per candidate position i,
an estimate of alpha_i = P(candidate i accepted | candidate i judged), censoring-aware: a position
after the first rejection was never judged and teaches nothing. Each step it predicts

    tokens(K) = 1 + sum_{j < K} prod_{i <= j} alpha_i
    cost(K)   = draft(K) + verify(K + 1) + overhead          (seconds; K = 0 is plain decoding)

verify(M) is the measured curve plus the attention the M rows do over positions cached since it was
measured (a per-row, per-position cost timed on the attention kernel at two context lengths): a long
prompt makes every verified row dearer, a plain step less so. One drift factor per curve follows what
the run's steps actually take (a busier machine), keeping the measured shape. The controller runs
the K with the most tokens per second; K = 0 wins unless a K > 0 is predicted to beat it by ``MARGIN``.
A step asking for K is priced at the lengths the drafter's proposals have had (``ProposalLengths``):
prompt lookup's match often runs out before K, and asking for more then costs only the rows it fills.

Without speculation nothing is learned about acceptance, so a probe step (the best K > 0) runs after
every ``PROBE_FIRST`` plain steps, or after as many as keep probes under ``PROBE_SHARE`` of the time if
that is more. A probe costs what it takes beyond the plain steps its tokens would have taken, at the
run's long-run acceptance (a draft costing most of a step whose candidates are rejected waits ~90
steps; one whose long run says speculation pays, after a dip, probes every ``PROBE_FIRST``):
speculation returns when the text turns predictable again. A speculating run stops only when
estimates pulled harder toward each position's long-run rate (``STEADY_WEIGHT`` pseudo-observations,
not ``PRIOR_WEIGHT``) also say no K pays: one rejection after
a long run of kept candidates is not a reason to stop (it sent a quantized self-draft plain for 39 of
71 steps). A proposal that ends
before K without the draft-side stop (prompt lookup's match ran out) counts as a rejection at the
position where it ended: the chain stopped there.

A run starts by learning: before ``WARMUP_JUDGED`` candidates have been judged, the prior (acceptance
1/2) decides nothing. The best K > 0 runs whatever the prediction, as long as these warm-up steps'
predicted extra cost over plain steps stays under ``WARMUP_SHARE`` of the run's plain decoding
(max_new_tokens plain steps): a 0.5B draft for a 1.5B target, at 0.37 of a step, gets 4 such steps in
a 128-token run. Without it one rejection in the first step sent that pair plain for 32 steps, on text
where fixed K = 2 ran 1.24x faster than plain decoding. The warm-up is paid once per process: a run
after others of the same target and drafter (same cost key) starts from their pooled acceptance, as
``EARLIER_RUNS`` judged candidates (``_LEARNED``, kept on disk beside the cost curve, so that a
process's first run, each ``verispec generate`` call, starts from what earlier processes learned:
from acceptance 1/2 a quantized self-draft's first 8 proposals stopped after one candidate). A drafter
that could not beat plain decoding by ``MARGIN`` even if every candidate were kept (K + 1 tokens a step:
a draft pass costing about a target step) neither warms up nor probes: no acceptance it could find
would make it speculate.

Draft-side stop (drafters with a distribution): after each drafted token the drafter asks whether to
go on. The controller keeps the acceptance rate of drafted tokens by the draft's confidence (the
probability of the token it chose, in ten bins) and stops when the expected gain of one more candidate,
P(every candidate so far accepted) x alpha_next, falls below its cost in tokens at the best fixed K's
rate: (draft step + one more verified row) x tokens per second. The confidence threshold is therefore
learned online from the measured costs and acceptance, not fixed. Once a drafter has reported its
confidence, a speculative step asks for up to K_MAX candidates and the stop sets the length: confident
stretches run past the best fixed K and a doubtful token ends the proposal (replayed on 28 recorded
prompts of the 0.5B -> 1.5B pair, ``benchmarks/auto_k_replay.py``: modelled 1.41x against the best fixed
K's 1.38x; the cost model's K alone, cut by the stop, 1.35x). Whether to speculate at all then compares
plain decoding with the better of the best fixed K's predicted rate and what the stop's steps achieved
lately; a stop step's prediction is made from the proposal as drafted (the acceptance by each
candidate's confidence), priced at the rows it holds.

Rated proposals (``cut``): a drafter whose proposal comes whole at next to no cost per candidate rates
each candidate (``Proposal.confidence``; prompt lookup: the length of the match behind it). A step asks
for K_MAX and the controller verifies the longest prefix whose every candidate is expected to add more
tokens (P(it and every one before it kept), from the acceptance by rating, learned as the draft's
confidence is) than its verified row's seconds buy at the yardstick rate; 0 makes it a plain step.
Asking then loses at most the drafter's own seconds, so while those are within MARGIN of a plain step
every step asks: plain stretches (decided on the acceptance by position, which poor matches drag down)
missed the well-matched proposals among poor ones. Replayed on SmolLM2-135M's 28 greedy prompts
(``benchmarks/auto_k_replay.py``): modelled 1.30x on the mix against the best fixed K's 1.25x, where
the cost model choosing K alone made 1.24x.

The draft curve is fitted as a line (a fixed part plus one draft step per candidate, ``draft_line``):
the stop prices each further candidate by the difference of neighbouring points, which one noisy
measurement would make wrong.

Exactness is untouched: K may change from step to step, the acceptance rule does not.

Modes (``k="auto"`` is "auto:both"): "auto:cost" (the cost model alone: K is the best fixed K's),
"auto:confidence" (K_MAX candidates, cut by the draft-side stop; never switches speculation off),
"auto:both" (the cost model decides whether to speculate, the stop how far).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from verispec import kernels
from verispec.errors import VerispecError
from verispec.machine import cpu_flags_digest, cpu_name
from verispec.paths import cache_dir

log = logging.getLogger(__name__)

# Judges a verification pass as the decoding loop does: (candidates [K], their q [K, vocab] or None, logits [K+1, vocab]).
Judge = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor], Any]

AUTO = "auto"
MODES = ("both", "cost", "confidence")
K_MAX = 8  # the largest K the controller considers
CURVE_ROWS = 16  # verification passes measured over M = 1..CURVE_ROWS positions
MARGIN = 0.03  # a K > 0 must be predicted this much faster than plain decoding
PROBE_FIRST = 8  # plain steps between probes at least ...
PROBE_SHARE = 0.01  # ... and enough that probes cost at most this share of the time
PLAIN_RECHECK = 4  # a plain stretch weighs its decision again every this many steps (and when a probe is due)
WARMUP_JUDGED = 8  # a run speculates until this many candidates were judged ...
WARMUP_SHARE = 0.015  # ... unless that would cost more than this share of its plain decoding
EARLIER_RUNS = 8.0  # earlier runs' acceptance starts a run as this many judged candidates at most
ROUNDS = 4  # measurements per point of the cost curve (the fastest counts), after one untimed round
ROW_DECAY = 0.99  # per-pass forgetting of what verified rows cost (a window of ~100 passes)
ROW_PRIOR = 4.0  # how hard the per-row extra leans on 0 (see RowCost)
DECAY = 0.95  # per-step forgetting of the acceptance estimates (a window of ~20 steps)
POOLED_DECAY = 0.995  # the long-run rates' (~200 steps)
PRIOR_WEIGHT = 2.0  # pseudo-observations pulling an estimate one level up (recent -> long run -> pool)
STEADY_WEIGHT = 6.0  # ... as many, for whether to stop speculating (see AutoK.choose)
BINS = 10  # draft-confidence bins
CACHE_VERSION = 7  # 2: curves carry the attention cost per cached position; 3: the draft curve is a line; 4: an untimed first round; 5: verification judged as the loop does; 6: the rows a curve measured; 7: learned acceptance by position


def parse_k(value: Any, what: str = "k (candidate length)") -> int | str:
    """A positive integer, or "auto" / "auto:MODE"; anything else is a ``VerispecError``."""
    from verispec.validation import is_int

    if isinstance(value, str):
        text = value.strip().lower()
        if text == AUTO or (text.startswith(AUTO + ":") and text.split(":", 1)[1] in MODES):
            return text
        if text.isdigit() and int(text) > 0:
            return _at_most_max(int(text), what)
    elif is_int(value) and value > 0:
        return _at_most_max(value, what)
    raise VerispecError(f"{what} must be a positive integer or 'auto' (or auto:{'/auto:'.join(MODES)}), got {value!r}")


def _at_most_max(k: int, what: str) -> int:
    if k > kernels.MAX_K:
        raise VerispecError(f"{what} must be at most {kernels.MAX_K}, got {k}: verification passes of up to {kernels.MAX_K + 1} "
                            "tokens are computed row by row, so that they agree with plain decoding bit for bit")
    return k


def is_auto(k: Any) -> bool:
    return isinstance(k, str) and k.startswith(AUTO)


def auto_mode(k: str) -> str:
    return k.split(":", 1)[1] if ":" in k else "both"


# ------------------------------------------------------------------------------------------ costs

@dataclasses.dataclass
class CostCurve:
    """Seconds measured on this machine for one target and drafter."""

    verify: list[float]  # [CURVE_ROWS] a verification pass over M = 1.. positions
    draft: list[float]  # [K_MAX + 1] a proposal of K = 0.. candidates (draft[0] = 0)
    overhead: float = 0.0  # per step outside drafting and verification (sampling, bookkeeping)
    measured_at: str = ""  # where: the machine and versions, for the record
    # A verification pass's rows attend to every cached position: the curve was measured with ``context``
    # positions cached, and each more costs ``attention`` seconds per row (all layers).
    context: int = 0
    attention: float = 0.0
    # Passes over M = 1..measured_rows were timed, longer ones extrapolated: a run with little room in its
    # cache (the bench's 8-token warm-up: 7 rows) cannot time the rest, and its curve priced 7-16 rows at
    # +0.2 ms a row where they cost ~9 ms (SmolLM2, bf16). A run with more room measures again.
    measured_rows: int = CURVE_ROWS

    def verify_at(self, rows: int, context: int) -> float:
        """A pass over ``rows`` positions with ``context`` positions cached."""
        return self.verify[rows - 1] + self.attention * rows * (context - self.context)

    def as_dict(self) -> dict[str, Any]:
        return {"verify_seconds": [round(v, 6) for v in self.verify], "draft_seconds": [round(d, 6) for d in self.draft],
                "overhead_seconds": round(self.overhead, 6), "measured_at": self.measured_at,
                "measured_context": self.context, "attention_seconds_per_row_position": self.attention,
                "measured_rows": self.measured_rows}


def machine() -> dict[str, Any]:
    """What a cost measurement depends on besides the models: CPU, its features, versions, threads, and
    the compiled runtime (its sources and switches: a faster kernel makes old costs wrong)."""
    import verispec

    return {"cpu": cpu_name(), "cpu_flags": cpu_flags_digest(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "verispec": verispec.__version__, "cache_version": CACHE_VERSION,
            "runtime": kernels.runtime()}


def _model_key(model: Any) -> dict[str, Any]:
    config = model.config
    return {"name": getattr(model, "name", ""), "class": type(model).__name__,
            "quantization": getattr(model, "quantization", None), "dtype": str(getattr(model, "dtype", "")),
            "layers": getattr(config, "num_layers", None), "hidden": getattr(config, "hidden_size", None),
            "vocab": config.vocab_size}


def cost_key(model: Any, drafter: Any, sampling: Any) -> dict[str, Any]:
    settings = {key: value for key, value in drafter.settings().items() if key != "k"}
    return {"machine": machine(), "target": _model_key(model), "drafter": type(drafter).__name__,
            "settings": json.loads(json.dumps(settings, default=str)), "judging": judging(sampling)}


def judging(sampling: Any) -> str:
    """What judging a verified row costs depends on: an argmax, or the sampling transform over the
    vocabulary (top-k and top-p add a selection or a sort)."""
    if sampling.greedy:
        return "greedy"
    return "sampled" + ("+top_k" if sampling.top_k else "") + ("+top_p" if sampling.top_p < 1 else "")


_MEASURED: dict[str, CostCurve] = {}  # this process's measurements, by key digest
# What this process's earlier runs of a target and drafter found, by the same digest: their long-run
# acceptance by candidate position as (kept, judged) counts, each run's (decayed) counts added to half
# the earlier ones.
_LEARNED: dict[str, tuple[list[float], list[float]]] = {}
_ROW_COSTS: dict[str, "RowCost"] = {}  # ... and what their passes showed a verified row to cost (``RowCost``)


def _cache_file(digest: str) -> Path:
    return cache_dir() / "costs" / f"{digest}.json"


def _learned_file(digest: str) -> Path:
    return cache_dir() / "costs" / f"{digest}.learned.json"


def _read_learned(digest: str) -> tuple[list[float], list[float]] | None:
    """The acceptance by candidate position (kept, judged counts) that earlier processes left for this
    cost key (its digest names the machine, versions, target and drafter); None (logged) when missing
    or unreadable."""
    path = _learned_file(digest)
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
        kept, judged = [float(v) for v in stored["kept"]], [float(v) for v in stored["judged"]]
        if stored.get("digest") != digest or len(kept) != K_MAX or len(judged) != K_MAX or not all(
                math.isfinite(j) and 0 <= k <= j for k, j in zip(kept, judged)):
            raise ValueError("wrong key or values")
        return kept, judged
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.info("learned acceptance %s is unreadable (%s); starting from the prior", path, exc)
        return None


def _write_learned(digest: str, kept: list[float], judged: list[float]) -> None:
    _write_json(_learned_file(digest), {"digest": digest, "kept": kept, "judged": judged}, "the learned acceptance")


def _read_cached(key: dict[str, Any], digest: str) -> CostCurve | None:
    """The curve stored for ``key``; None (logged) when the file is missing, corrupt or measured for
    another machine or version."""
    path = _cache_file(digest)
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") != key:
            log.info("cost cache %s was measured for another machine or version; measuring again", path)
            return None
        curve = CostCurve(**stored["curve"])
        good = (len(curve.verify) == CURVE_ROWS and len(curve.draft) == K_MAX + 1
                and all(isinstance(v, float) and math.isfinite(v) and v >= 0
                        for v in curve.verify + curve.draft + [curve.attention])
                and isinstance(curve.context, int) and curve.context >= 0
                and isinstance(curve.measured_rows, int) and 1 <= curve.measured_rows <= CURVE_ROWS)
        if not good:
            raise ValueError("wrong shape or values")
        return curve
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.info("cost cache %s is unreadable (%s); measuring again", path, exc)
        return None


def _write_cached(key: dict[str, Any], digest: str, curve: CostCurve) -> None:
    _write_json(_cache_file(digest), {"key": key, "curve": dataclasses.asdict(curve)}, "the cost measurement")


def _write_json(path: Path, payload: dict[str, Any], what: str) -> None:
    """Store ``payload`` at ``path`` whole or not at all (a cache: failing to write is logged, not raised)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(payload))
        tmp.replace(path)  # never a half-written file under the real name
    except OSError as exc:
        log.info("cannot store %s in %s: %s", what, path, exc)


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def cost_curve(model: Any, drafter: Any, context: Any, judge: Judge | None = None) -> tuple[CostCurve, bool, str]:
    """The costs for this target and drafter (a copy the run may refine), whether they were measured
    now (from this process, else the disk cache, else measured), and the key's digest."""
    key = cost_key(model, drafter, context.sampling)
    digest = _digest(key)
    curve = _MEASURED.get(digest) or _read_cached(key, digest)
    measured = curve is None or curve.measured_rows < _room_rows(context)  # none, or this run can time more rows
    if measured:
        curve = measure(model, drafter, context, judge)
        curve.measured_at = f"{key['machine']['cpu']}, {key['machine']['threads']} threads, torch {torch.__version__}"
        _write_cached(key, digest, curve)
    _MEASURED[digest] = curve
    return dataclasses.replace(curve, verify=list(curve.verify), draft=list(curve.draft)), measured, digest


def _room_rows(context: Any) -> int:
    """The longest pass (of at most CURVE_ROWS rows) the run's cache has room for now."""
    return max(1, min(CURVE_ROWS, context.cache.capacity - (len(context.tokens) - 1)))


def measure(model: Any, drafter: Any, context: Any, judge: Judge | None = None) -> CostCurve:
    """Time real steps without committing anything: for K = 0..K_MAX a proposal and its verification
    through the drafter (best of ROUNDS, interleaved), then plain passes over M = K_MAX+2..CURVE_ROWS positions. The
    caches are rolled back after each, and the drafter draws from its own generator, so the run's
    random stream (and therefore its output for a seed) is the same whether or not this runs.

    A verification's time includes judging its rows as the loop does (``judge``: the acceptance rule on
    the logits, through the sampling transform): at T = 0.7 on SmolLM2's 49,152-token vocabulary that
    adds 0.14 ms a row (9 rows: 1.3 ms against 0.19 for one, on a 7-9 ms step), a cost the pass alone
    does not show and one factor for every row count cannot follow.

    One untimed round goes first: the first pass over each row count sets up what later ones reuse
    (buffers, kernel state), and right after a model loads the machine is slow for a while. Without it
    the first curve of a process (SmolLM2 int8, prompt lookup) priced M = 1 -> 2 rows at +0.2 ms and
    M = 2 -> 5 at +1.4 ms, where passes timed later took +1.0 and +1.0 ms (measured twice, 25 rounds)."""
    cache, n = context.cache, len(context.tokens)
    room = cache.capacity - (n - 1)  # positions a pass may write now
    probe = dataclasses.replace(context, generator=torch.Generator().manual_seed(0))
    last = context.tokens[-1]
    verify = [math.inf] * CURVE_ROWS
    draft = [math.inf] * (K_MAX + 1)
    draft[0] = 0.0
    with torch.inference_mode():
        drafter.propose(probe, 1)  # warm up (a draft model catches up on the prompt here)
        drafter.accepted(0)
        model.forward(torch.tensor([last]), cache, n - 1)
        cache.rollback(n - 1)
        for timed in [False] + [True] * ROUNDS:
            for k in range(min(K_MAX, room - 1) + 1):
                t0 = time.perf_counter()
                proposal = drafter.propose(probe, k) if k else None
                t1 = time.perf_counter()
                drafted = proposal.tokens.tolist() if proposal is not None else []
                inputs = torch.tensor([last] + drafted + [last] * (k - len(drafted)))  # [k+1]
                logits = drafter.target_logits(probe, inputs) if k else model.forward(inputs, cache, n - 1)
                if judge is not None:
                    probs = proposal.probs if proposal is not None and len(drafted) == k else None
                    judge(inputs[1:], probs, logits)
                t2 = time.perf_counter()
                cache.rollback(n - 1)
                if k:
                    drafter.accepted(0)
                if timed:
                    draft[k], verify[k] = min(draft[k], t1 - t0), min(verify[k], t2 - t1)
            for m in range(K_MAX + 2, min(CURVE_ROWS, room) + 1):
                t0 = time.perf_counter()
                inputs = torch.tensor([last] * m)
                logits = model.forward(inputs, cache, n - 1)
                if judge is not None:
                    judge(inputs[1:], None, logits)
                if timed:
                    verify[m - 1] = min(verify[m - 1], time.perf_counter() - t0)
                cache.rollback(n - 1)
    return CostCurve(_fill(verify), draft_line(_fill(draft)), context=n - 1, attention=attention_seconds(model),
                     measured_rows=_room_rows(context))


def attention_seconds(model: Any, rows: int = 4, short: int = 64, long: int = 1024) -> float:
    """Seconds one more cached position adds to a row's attention, over all layers: the native runtime's
    few-row attention timed on random tensors at two context lengths (0 for other backends)."""
    from verispec.models.protocol import LayeredModel

    if not isinstance(model, LayeredModel):
        return 0.0
    c = model.config
    g = torch.Generator().manual_seed(0)
    q = torch.randn(c.num_heads, rows, c.head_dim, generator=g)
    keys = torch.randn(c.num_kv_heads, long + rows, c.head_dim, generator=g)
    values = torch.randn(c.num_kv_heads, long + rows, c.head_dim, generator=g)

    def seconds(start: int) -> float:
        best = math.inf
        for _ in range(ROUNDS + 1):
            t0 = time.perf_counter()
            kernels.causal_attention(q, keys, values, start)
            best = min(best, time.perf_counter() - t0)
        return best

    return max(0.0, (seconds(long) - seconds(short)) / (rows * (long - short)) * c.num_layers)


def _fill(values: list[float]) -> list[float]:
    """Unmeasured entries (no room) extrapolated linearly; then the lower envelope from the right,
    so one slow measurement (noise) does not make a larger pass look cheaper than a smaller one."""
    known = [i for i, v in enumerate(values) if math.isfinite(v)]
    out = list(values)
    if len(known) >= 2:
        a, b = known[-2], known[-1]
        slope = max(0.0, (values[b] - values[a]) / (b - a))
        for i in range(b + 1, len(out)):
            out[i] = values[b] + slope * (i - b)
    elif known:
        out = [values[known[0]] if not math.isfinite(v) else v for v in out]
    else:
        out = [0.0] * len(out)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def draft_line(draft: list[float]) -> list[float]:
    """The draft costs for K = 1..K_MAX as a line a + b K (draft[0] stays 0), fitted robustly: b the
    median of the slopes between every two points, a the median of what remains (a, b >= 0).

    A proposal of K candidates costs a fixed part (a draft model's catch-up pass, a lookup) plus one
    draft step per candidate, so the curve is a line; single points of it are noisy on a shared machine
    (one measurement put K = 4 at 95 ms between 60 at K = 3 and 112 at K = 5), and the draft-side stop
    prices each further candidate by the difference of neighbouring points, which one noisy point makes
    wrong. A median ignores a few such points where a least-squares line would lean towards them.
    """
    ks = [k for k in range(1, len(draft)) if math.isfinite(draft[k])]
    if len(ks) < 2:
        return list(draft)
    slope = max(0.0, statistics.median((draft[j] - draft[i]) / (j - i) for i in ks for j in ks if j > i))
    base = max(0.0, statistics.median(draft[k] - slope * k for k in ks))
    return [0.0] + [base + slope * k for k in range(1, len(draft))]


# ------------------------------------------------------------------------------------------ acceptance

class Acceptance:
    """Per-position acceptance estimates, censoring-aware, forgetting with every step, at two speeds.

    Every step (plain ones too) discounts what is known: the recent counts by ``DECAY`` (~20 steps),
    so after a stretch without speculation a probe's result outweighs what was seen long ago, and the
    long-run counts ten times slower (``POOLED_DECAY``, ~200 steps). The estimates are nested: the
    recent rate at a position shrinks toward that position's long-run rate, which shrinks toward the
    rate pooled over every position (and that toward 1/2). A position not judged lately (K was
    smaller) takes its own long-run rate, or the run's general rate if it was never judged. Without the per-position long run, the first candidate's estimate shrank
    toward a pool that later, less often kept positions dragged down: a quantized self-draft whose
    first candidate was kept 93% of the time looked, after two rejections, as if K=1 did not pay.
    """

    def __init__(self, positions: int = K_MAX) -> None:
        self.judged = [0.0] * positions
        self.kept = [0.0] * positions
        self.slow_judged = [0.0] * positions  # the long-run counts, by position
        self.slow_kept = [0.0] * positions
        self.pooled_judged = self.pooled_kept = 0.0
        self.bin_judged = [0.0] * BINS  # by draft confidence
        self.bin_kept = [0.0] * BINS

    def observe(self, proposed: int, accepted: int, confidence: list[float] | None = None,
                forget: bool = True) -> None:
        """One step: ``proposed`` candidates, the first ``accepted`` kept. Positions 0..accepted were
        judged (the last of them rejected unless all were kept); later ones were not. ``forget=False``:
        the step's forgetting was done already."""
        if forget:
            self.forget()
        for i in range(min(proposed, accepted + 1, len(self.judged))):
            kept = float(i < accepted)
            self.judged[i] += 1
            self.kept[i] += kept
            self.slow_judged[i] += 1
            self.slow_kept[i] += kept
            self.pooled_judged += 1
            self.pooled_kept += kept
            if confidence is not None and i < len(confidence):
                b = self.bin(confidence[i])
                self.bin_judged[b] += 1
                self.bin_kept[b] += kept

    def forget(self, steps: int = 1) -> None:
        """What ``steps`` steps do to the counts before their own observations (a plain step: all it does)."""
        fast, slow = DECAY ** steps, POOLED_DECAY ** steps
        for values, decay in ((self.judged, fast), (self.kept, fast), (self.bin_judged, fast),
                              (self.bin_kept, fast), (self.slow_judged, slow), (self.slow_kept, slow)):
            values[:] = [decay * v for v in values]
        self.pooled_judged *= slow
        self.pooled_kept *= slow

    def start_from(self, kept: list[float], judged: list[float], weight: float) -> None:
        """Begin from earlier runs' counts by position, each position's as at most ``weight`` judged
        candidates, and the pooled rate as ``weight`` of them. The prior stays 1/2: centred on an earlier
        rate of 0 (a bench's 8-token warm-up whose lookup candidates were all rejected), prompt lookup's
        cut verified nothing for whole runs, so nothing could show it wrong."""
        rate = sum(kept) / sum(judged)
        self.pooled_kept, self.pooled_judged = weight * rate, weight
        for i, (k, j) in enumerate(zip(kept, judged)):
            if j > 0:
                w = min(j, weight)
                self.slow_kept[i], self.slow_judged[i] = w * k / j, w

    @property
    def pooled(self) -> float:
        return (self.pooled_kept + 0.5 * PRIOR_WEIGHT) / (self.pooled_judged + PRIOR_WEIGHT)

    def long_run(self) -> list[float]:
        """Per position, the long-run rate pulled toward the pooled one by PRIOR_WEIGHT pseudo-observations."""
        pooled = self.pooled
        return [(k + PRIOR_WEIGHT * pooled) / (j + PRIOR_WEIGHT) for k, j in zip(self.slow_kept, self.slow_judged)]

    def alphas(self, weight: float = PRIOR_WEIGHT) -> list[float]:
        """Per position, the recent rate pulled toward the position's long-run one by ``weight`` pseudo-observations."""
        return [(k + weight * a) / (j + weight) for k, j, a in zip(self.kept, self.judged, self.long_run())]

    @staticmethod
    def bin(confidence: float) -> int:
        return min(BINS - 1, max(0, int(confidence * BINS)))

    def by_confidence(self, confidence: float) -> float:
        """P(a candidate drafted with this confidence is kept): its bin's rate, pulled toward the pooled one."""
        return self.by_confidences((confidence,))[0]

    def by_confidences(self, confidences: Iterable[float]) -> list[float]:
        """``by_confidence`` of each, the pooled prior computed once (a rated proposal's candidates are
        rated together: one call a step instead of one per candidate, in the controller's per-step cost)."""
        prior, kept, judged = PRIOR_WEIGHT * self.pooled, self.bin_kept, self.bin_judged
        return [(kept[b] + prior) / (judged[b] + PRIOR_WEIGHT) for b in map(self.bin, confidences)]


class ProposalLengths:
    """How far proposals reach when asked for K candidates: prompt lookup's match often runs out before K
    (asked for 4, it proposed 2.2 candidates per step on short prompts), so asking for more costs only
    the rows it fills. Per position i, the chance that a proposal holding i candidates holds an
    (i+1)-th, counted over proposals that were asked for more than i (censoring-aware, forgetting like
    the acceptance estimates), and pulled toward the pooled chance, whose prior is 1: drafters that
    always fill K (draft models, layer skipping, ...) are priced at K rows from the start.
    """

    def __init__(self, positions: int = K_MAX) -> None:
        self.at_risk = [0.0] * positions  # index i: proposals holding i candidates, asked for more
        self.reached = [0.0] * positions  # ... that held an (i+1)-th

    def observe(self, asked: int, proposed: int) -> None:
        """A proposal asked for ``asked`` candidates held ``proposed`` (>= 1), not cut by a stop."""
        self.at_risk[:] = [DECAY * v for v in self.at_risk]
        self.reached[:] = [DECAY * v for v in self.reached]
        for i in range(1, min(asked, proposed + 1, len(self.at_risk))):
            self.at_risk[i] += 1
            self.reached[i] += float(i < proposed)

    def continues(self) -> list[float]:
        """Per position i (index 1..): the chance that a proposal holding i candidates holds one more."""
        pooled = (sum(self.reached) + PRIOR_WEIGHT) / (sum(self.at_risk) + PRIOR_WEIGHT)
        return [1.0] + [(r + PRIOR_WEIGHT * pooled) / (a + PRIOR_WEIGHT)
                        for r, a in zip(self.reached[1:], self.at_risk[1:])]

    def expected(self, values: list[float]) -> list[float]:
        """For k = 0..len(values) - 1: the mean of ``values[j]`` over the lengths j a proposal asked for
        k holds (given it holds any; k = 0: values[0])."""
        goes_on = self.continues()
        out, ended, reach = [values[0]], 0.0, 1.0  # ended: sum over lengths j < k of P(length j) values[j]
        for k in range(1, len(values)):
            out.append(ended + reach * values[k])
            if k < len(goes_on):
                ended += reach * (1 - goes_on[k]) * values[k]
                reach *= goes_on[k]
        return out


class RowCost:
    """What a verified row beyond the first costs over the measured curve's price, from the run's own
    passes: the slope of (observed - curve price), in the curve's seconds, against the rows beyond the
    first, by weighted least squares that forget (``ROW_DECAY`` a pass) and lean on 0 (as if ``ROW_PRIOR``
    more passes, at the passes' typical row count, had shown no extra). The level is ``verify_scale``'s:
    an offset common to every row count goes into the intercept, not the slope.

    The calibration takes the fastest of a few passes per row count, on the prompt's context, at one
    moment; the run's passes are its own. On SmolLM2-135M (int8, prompt lookup, greedy) passes of 3-7
    rows took 5-10% more than the curve scaled to the run's 1-row passes (0.2-0.3 ms a row); the cut
    and the draft-side stop, which price one more row, then verified rows that did not pay.
    """

    def __init__(self) -> None:
        self.sums = [0.0] * 5  # weight, sum x, sum x^2, sum r, sum x r (x: rows beyond the first; r: residual)
        self.extra = 0.0

    def observe(self, rows: int, observed: float, price: float, one_row: float) -> None:
        """A pass over ``rows`` positions took ``observed`` (in curve seconds, after the level) where the
        curve says ``price``; ``one_row``: the curve's 1-row pass (bounds an outlier's pull)."""
        if not (observed > 0 and price > 0):
            return
        observed = min(max(observed, 0.5 * price), 2.0 * price)  # a pause, or a lucky moment: bounded
        x, r = float(rows - 1), observed - price
        w = self.sums
        w[:] = [ROW_DECAY * v for v in w]
        for i, value in enumerate((1.0, x, x * x, r, x * r)):
            w[i] += value
        n, sx, sxx, sr, sxr = w
        ridge = ROW_PRIOR * (sxx / n if n else 1.0) + 1e-12  # leaning on a slope of 0
        slope = (n * sxr - sx * sr) / (n * sxx - sx * sx + n * ridge)
        self.extra = max(-0.05 * one_row, min(one_row, slope))  # (the curve's own steps stay about level)

    def halved(self) -> "RowCost":
        """For the process's next run: this evidence at half its weight."""
        out = RowCost()
        out.sums = [0.5 * v for v in self.sums]
        out.extra = self.extra
        return out


def _drift(scale: float, ratio: float) -> float:
    """One step's observed/curve time ratio folded into ``scale`` (an average in log space; one
    observation moves it at most 2x, so a pause in the process does not reprice every K)."""
    if not ratio > 0:
        return scale
    step = max(-math.log(2), min(math.log(2), math.log(ratio) - math.log(scale)))
    return scale * math.exp(0.1 * step)


def chain_tokens(alphas: list[float], k_max: int) -> list[float]:
    """Committed tokens per step with K = 0..k_max candidates: 1 + sum_{j<K} prod_{i<=j} alpha_i."""
    out, total, reach = [1.0], 1.0, 1.0
    for a in alphas[:k_max]:
        reach *= a
        total += reach
        out.append(total)
    return out


def expected_tokens(alphas: list[float], k: int) -> float:
    return chain_tokens(alphas, k)[k]


# ------------------------------------------------------------------------------------------ controller

class AutoK:
    """Chooses K per step; see the module docstring. One controller per run."""

    def __init__(self, mode: str = "both") -> None:
        if mode not in MODES:
            raise VerispecError(f"k='auto:{mode}': the mode must be one of {', '.join(MODES)}")
        self.mode = mode
        self.curve: CostCurve | None = None
        self.acceptance = Acceptance()
        self.lengths = ProposalLengths()
        self.steps = 0
        self.plain_steps = self.probes = self.warmup_steps = 0
        self.candidates_cut = self.cut_to_plain = 0  # by ``cut``: candidates dropped, steps made plain
        self._cut_in_a_row = 0  # proposals ``cut`` to nothing since one was verified
        self.judged = 0  # candidates judged in this run (not decayed): the warm-up's evidence
        self._warmup_budget: float | None = None  # seconds the warm-up may cost over plain steps
        self.since_speculation = 0  # plain steps in a row
        # Steps that asked for candidates and got some, of those that asked (decayed like the acceptance
        # counts): prompt lookup proposes nothing where its n-gram has no earlier match, and such a
        # step costs a plain step, not a rejection.
        self.asked = self.answered = 0.0
        self.failed: str | None = None
        self.calibration_seconds = 0.0
        self._digest: str | None = None  # the cost key's: names what earlier runs learned
        self.prior_runs_rate: float | None = None  # the pooled acceptance earlier runs left (None: none)
        # What the run's steps take relative to the measured curve: verification (every step, plain ones
        # too: the machine's drift), and drafting relative to that (a run that is mostly plain drafts
        # rarely, and its drafts slow down with the machine as the target's passes do).
        self.verify_scale = self.draft_scale = 1.0
        self.row_cost = RowCost()  # what a verified row beyond the first costs over the curve's price
        # predicted and measured, summed over steps (plain-step seconds are the yardstick)
        self.predicted_plain_seconds = self.predicted_seconds = 0.0
        self.committed_plain_seconds = self.actual_seconds = 0.0
        # the current step
        self._prediction = (1.0, 0.0)  # (tokens, seconds) predicted for the K chosen
        self._tokens: list[int] = []  # the run's tokens, once started
        self._step_context = 0  # positions cached when the current step was chosen
        self._rate = 0.0
        self._reach = 1.0
        self._confidence: list[float] = []
        self._stopped = False  # the draft-side stop ended this proposal
        self._confidence_seen = False  # the drafter reports its confidence (the stop can work)
        self._rated = False  # ... for whole proposals at once (``cut``): a longer ask costs it nothing
        self._stop_step = False  # the current step's length is the draft-side stop's
        self._stop_tokens = self._stop_seconds = 0.0  # such steps' predicted tokens and seconds, decayed
        self._alphas = self.acceptance.alphas()
        # A plain stretch's fast path: steps left before its decision is weighed again, and the steps
        # taken meanwhile, learned from only when it is (``_catch_up``; the same updates, in order).
        self._plain_ahead = 0
        self._ask_ahead = 0  # ... and a rated drafter's asking stretch: steps left that ask K_MAX unweighed
        self._costs_learned = 0  # steps ``_learn_costs`` has seen (the first sets the overhead)
        self._deferred: list[tuple[int, int, int, float, float]] = []

    def start(self, model: Any, drafter: Any, context: Any, judge: Judge | None = None) -> None:
        """Before the run's first step: the cost curve (measured now, ``judge`` judging each timed pass as
        the loop does, or from the caches) and what earlier runs learned."""
        self._tokens = context.tokens  # the run's committed tokens (the loop extends this list)
        began = time.perf_counter()
        try:
            self.curve, measured, self._digest = cost_curve(model, drafter, context, judge)
            self.calibration_seconds = time.perf_counter() - began if measured else 0.0
            self._start_from_earlier_runs()
        except VerispecError:
            raise
        except Exception as exc:  # a drafter that fails while being measured: decode plainly, say so
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("k='auto': measuring the drafter failed (%s); decoding without speculation", self.failed)

    def _start_from_earlier_runs(self) -> None:
        """Begin from what this process's earlier runs of this target and drafter found: their pooled
        acceptance, as up to EARLIER_RUNS judged candidates (a prior the run's own steps soon outweigh;
        it forgets like the pooled rate). With that much evidence the warm-up is not needed: a drafter
        known not to pay starts plain (and probes), one known to pay starts speculating."""
        if self._digest in _ROW_COSTS:
            self.row_cost = _ROW_COSTS[self._digest].halved()
        if self._digest not in _LEARNED and (stored := _read_learned(self._digest)) is not None:
            _LEARNED[self._digest] = stored  # an earlier process's runs: each CLI call is a process
        kept, judged = _LEARNED.get(self._digest, ([0.0], [0.0]))
        if sum(judged) <= 0:
            return
        weight = min(sum(judged), EARLIER_RUNS)
        self.acceptance.start_from(kept, judged, weight)
        self.judged = weight
        self.prior_runs_rate = sum(kept) / sum(judged)

    def finish(self) -> None:
        """The run has ended: leave its pooled acceptance for the process's next run (``start``)."""
        self._catch_up()
        if not self.active or self._digest is None:
            return
        _ROW_COSTS[self._digest] = self.row_cost
        a = self.acceptance
        if sum(a.slow_judged) <= 0:
            return
        kept, judged = _LEARNED.get(self._digest, ([0.0] * K_MAX, [0.0] * K_MAX))
        _LEARNED[self._digest] = ([0.5 * k + s for k, s in zip(kept, a.slow_kept)],
                                  [0.5 * j + s for j, s in zip(judged, a.slow_judged)])
        _write_learned(self._digest, *_LEARNED[self._digest])

    @property
    def active(self) -> bool:
        return self.curve is not None and not self.failed

    def cost(self, k: int, context: int | None = None) -> float:
        """Seconds of a step with k candidates, at ``context`` cached positions (default: the run's now)."""
        if self._deferred:
            self._catch_up()
        curve = self.curve
        rows = self._price(k + 1, len(self._tokens) - 1 if context is None else context)
        return (curve.draft[k] * self.draft_scale + rows) * self.verify_scale + curve.overhead

    def _price(self, rows: int, context: int) -> float:
        """A pass over ``rows`` positions in the curve's seconds: the measured curve, and the extra per row
        beyond the first that the run's (and the process's earlier runs') own passes show (``RowCost``)."""
        return self.curve.verify_at(rows, context) + self.row_cost.extra * (rows - 1)

    def asking(self, k_max: int = K_MAX) -> list[float]:
        """Expected seconds of a step that asks for k = 0..k_max candidates and gets some: priced at the
        lengths the drafter's proposals have had (``ProposalLengths``), not at k rows whatever it holds."""
        return self.lengths.expected([self.cost(j) for j in range(k_max + 1)])

    def _verify(self, rows: int) -> float:
        """The cost of a pass over ``rows`` positions at the run's current context (curve seconds)."""
        return self._price(rows, len(self._tokens) - 1)

    @property
    def proposes(self) -> float:
        """The chance that a step asking for candidates gets any (1 for drafters that always propose)."""
        return (self.answered + PRIOR_WEIGHT) / (self.asked + PRIOR_WEIGHT)

    def rates(self, budget: int = K_MAX, seconds: list[float] | None = None) -> list[float]:
        """Predicted committed tokens per second for K = 0..min(K_MAX, budget), for a step whose drafter
        proposes (a step asking for candidates and getting none is a plain step: K = 0's rate);
        ``seconds``: ``asking``'s prices for those K, when the caller has them."""
        self._catch_up()
        self._alphas = self.acceptance.alphas()
        return self._rates(self._alphas, self.asking(min(K_MAX, budget)) if seconds is None else seconds)

    @staticmethod
    def _rates(alphas: list[float], seconds: list[float]) -> list[float]:
        """Tokens per second for K = 0..len(seconds) - 1 with per-position acceptance ``alphas``, a step
        asking for K costing ``seconds[K]``."""
        return [tokens / s for tokens, s in zip(chain_tokens(alphas, len(seconds) - 1), seconds)]

    def choose(self, budget: int) -> int:
        """K for the next step (``budget``: candidates the run can still use).

        In a plain stretch the decision is weighed every PLAIN_RECHECK steps and on the step a probe is
        due, not every step: in between, estimates change only by forgetting, and the whole evaluation
        cost ~40 us a step with the interpreter's caches cold after a target pass (layer skip and
        early exit runs that stayed plain ran 1.5-3% behind plain decoding, BENCHMARKS.md section 23)."""
        self._step_context = len(self._tokens) - 1
        if self._plain_ahead > 0:
            self._plain_ahead -= 1
            return 0
        if self._ask_ahead > 0 and budget >= K_MAX:  # a rated drafter's asking stretch (see below)
            self._ask_ahead -= 1
            self._reach, self._confidence, self._stopped = 1.0, [], False
            return K_MAX
        self._catch_up()
        if not self.active:
            return 0
        if budget <= 0:
            self._prediction = (1.0, self.cost(0))
            return 0
        seconds = self.asking(min(K_MAX, budget))  # [K+1] a step asking for K = 0.. (computed once a step)
        rates = self.rates(budget, seconds)
        best = max(range(1, len(rates)), key=rates.__getitem__)
        extra = seconds[best] - seconds[0]  # what asking for the best K costs over a plain step
        # With the draft-side stop the proposal's length follows the draft's confidence, up to K_MAX: what
        # speculating achieves is then what such steps have achieved lately, when that beats the best K.
        stops = self.mode != "cost" and self._confidence_seen
        spec_rate = max(rates[best], self.stop_rate) if stops else rates[best]
        if self._warmup_budget is None:  # the first step: the run's plain decoding is ``budget`` steps
            self._warmup_budget = WARMUP_SHARE * budget * seconds[0]
        pays = spec_rate > rates[0] * (1 + MARGIN)
        if not pays and self.judged >= WARMUP_JUDGED and self.steps and not self.since_speculation:
            # Whether to stop speculating rests on steadier estimates, pulled harder toward each
            # position's long-run rate: one rejection after a long run of kept candidates is no reason to stop. With
            # the recent estimates alone (2 pseudo-observations) the first step's rejection of a
            # quantized self-draft, kept ~92% of the time over the text, took the first position's
            # estimate from 0.89 to 0.54 and the run plain for 39 of its 71 steps (Spec-Bench rag 483,
            # 1.11x where fixed K=2 ran 1.24x; BENCHMARKS.md section 20). A stretch of rejections still
            # turns speculation off. Only a speculating run asks: once plain, probes bring it back as
            # before (asked on plain steps too, an estimate on the edge turned speculation on and off
            # every other step through a stretch where nothing was kept).
            pays = self._some_k_pays(self._rates(self.acceptance.alphas(STEADY_WEIGHT), seconds))
        if stops and self._rated and not pays:
            # ``cut`` verifies only the candidates predicted to pay, so asking loses at most the draft's
            # seconds: where those are within MARGIN of a plain step, every step asks (a plain stretch
            # would miss the well-matched proposals among poor ones: fixed K=4 ran 1.27x on a Spec-Bench
            # mt_bench prompt where plain stretches with probes ran 1.09x, replayed).
            pays = self.curve.draft[K_MAX] * self.draft_scale * self.verify_scale <= MARGIN * seconds[0]
        if self.mode == "confidence" or pays:
            k = best
        elif not self._could_pay(seconds):
            k = 0  # not even a draft whose every candidate is kept would beat plain decoding: nothing to learn
            self._plain_ahead = PLAIN_RECHECK - 1
        elif self.judged < WARMUP_JUDGED and extra <= self._warmup_budget:
            k = best  # still learning what this drafter achieves on this text
            self._warmup_budget -= extra
            self.warmup_steps += 1
        elif self.since_speculation >= (due := max(PROBE_FIRST, self._probe_wait(best, seconds))):
            k = best  # a probe: what does acceptance look like now?
            self.probes += 1
        else:
            k = 0
            # the steps before the probe is due (this one makes since_speculation one more), at most
            # PLAIN_RECHECK - 1 of them
            self._plain_ahead = max(0, min(PLAIN_RECHECK - 1, math.ceil(due - self.since_speculation) - 1))
        # The stop's yardstick: one more candidate must add more tokens than its seconds buy at this rate.
        self._rate = rates[best]
        m = self.proposes if k else 1.0  # without a proposal the step is a plain one
        self._prediction = (m * rates[k] * seconds[k] + (1 - m), m * seconds[k] + (1 - m) * seconds[0])
        # Only where speculating is predicted to pay: a warm-up step or a probe keeps the best fixed K's
        # length (cut by the stop), so a drafter that cannot pay never spends 8 draft steps finding out.
        # A drafter whose proposals come whole and rated (``cut``) drafts K_MAX at no extra cost, and a probe
        # of it is such a step too: the cut keeps what its confidence says pays, and the step tells what
        # they achieve now.
        self._stop_step = bool(k) and (self.mode == "confidence" or (stops and (pays or self._rated)))
        if self._stop_step:
            k = len(rates) - 1  # the draft-side stop chooses the length (its prediction: see observe)
        # A rated drafter that asks because asking pays (``cut`` keeps what pays) asks again for the next
        # PLAIN_RECHECK - 1 steps without weighing: the decision rests on the draft's price against a
        # plain step, which moves slowly, and each step's own prediction is made from its proposal (see
        # observe). The full decision cost ~70 us a step in place (prompt lookup's auto spent ~0.2 ms a
        # step more outside the passes than fixed K = 2, BENCHMARKS.md section 24).
        self._ask_ahead = PLAIN_RECHECK - 1 if self._stop_step and self._rated and pays else 0
        self._reach, self._confidence, self._stopped = 1.0, [], False
        return k

    @staticmethod
    def _some_k_pays(rates: list[float]) -> bool:
        """Whether some K > 0 of ``rates`` (tokens per second for K = 0..) beats plain decoding by MARGIN."""
        return max(rates[1:]) > rates[0] * (1 + MARGIN)

    @staticmethod
    def _could_pay(seconds: list[float]) -> bool:
        """Whether some K would beat plain decoding by MARGIN if every candidate were accepted (K + 1
        tokens a step): where not (a draft pass costing about a target step), warm-up and probes can
        only lose time, whatever acceptance they would find."""
        return any((k + 1) / s > (1 + MARGIN) / seconds[0] for k, s in enumerate(seconds) if k)

    @property
    def stop_rate(self) -> float:
        """Committed tokens per second that steps whose length the draft-side stop chose achieved
        (measured; decayed like the acceptance counts; 0 before any)."""
        return self._stop_tokens / self._stop_seconds if self._stop_seconds > 0 else 0.0

    def _probe_wait(self, k: int, seconds: list[float]) -> float:
        """Plain steps between probes of ``k`` candidates (a step asking for k costs ``seconds[k]``) so
        that probes cost at most PROBE_SHARE of the time. A probe's cost is what it takes beyond the
        plain steps its tokens would have taken, at the long-run acceptance by position (~200 steps): a
        plain stretch in a run whose long run says speculation pays is more likely a dip than the text's
        nature, and such a probe about pays for itself. Priced at its whole extra time, a quantized
        self-draft costing 0.7 of a step, its first candidate kept 90% of the time, probed once in 80
        steps and ran runs on the edge of paying plain for most of their steps; a 0.5B draft for a 1.5B
        target (0.36 of a step) waited ~37 plain steps after every dip."""
        net = seconds[k] - expected_tokens(self.acceptance.long_run(), k) * seconds[0]
        return max(0.0, net) / (PROBE_SHARE * seconds[0])

    @property
    def wants_confidence(self) -> bool:
        return self.mode != "cost" and self.active

    def keep_drafting(self, confidence: float) -> bool:
        """The draft-side stop, asked after each drafted token with the draft's probability of it:
        go on while one more candidate is expected to add more tokens than its cost takes away."""
        self._confidence.append(confidence)
        self._confidence_seen = True
        self._plain_ahead = 0  # a drafter's confidence changes what pays (see choose)
        k = len(self._confidence)
        if k >= K_MAX:
            return True
        self._reach *= self.acceptance.by_confidence(confidence)
        curve = self.curve
        # seconds as ``cost`` prices them (``_rate`` is tokens per such second)
        extra_seconds = ((curve.draft[k + 1] - curve.draft[k]) * self.draft_scale
                         + self._verify(k + 2) - self._verify(k + 1)) * self.verify_scale
        go_on = self._reach * self._alphas[k] > extra_seconds * self._rate
        self._stopped = not go_on
        return go_on

    def cut(self, confidence: list[float]) -> int:
        """How many candidates of a proposal known at once (prompt lookup's), each rated by ``confidence``,
        are worth verifying: the prefix whose expected tokens (each candidate's P(it and all before it
        kept), from the acceptance by confidence) most exceed what its verified rows' seconds buy at the
        yardstick rate (the stop's). 0 makes the step a plain one. Drafting is already paid, so only
        rows count. The whole proposal is weighed, not only up to the first candidate that does not pay
        for its own row: the verification curve is not convex (on an AMX Xeon, int8 SmolLM2-135M took
        4.3, 4.9, 5.9, 6.1, 6.1, 6.1 ms for 1-6 rows), so a candidate whose row costs a step up can be
        worth it for the free rows behind it (ending at the first such candidate, the cut ran 15% behind
        fixed K = 4 on Spec-Bench math, BENCHMARKS.md section 27).

        A step cut to nothing judges nothing, so estimates that say no candidate pays could never be
        shown wrong: after PROBE_FIRST proposals in a row cut to nothing, the next keeps its first
        candidate (a probe of one verified row)."""
        self._confidence_seen = self._rated = True
        self._plain_ahead = 0  # rated proposals change what pays (see choose)
        reach, keep, gain, best = 1.0, 0, 0.0, 0.0
        bought = self.verify_scale * self._rate  # tokens a curve second buys at the yardstick rate
        base = self._verify(1)  # the pass without candidates
        ratings = self.acceptance.by_confidences(confidence[:K_MAX])
        for j, rating in enumerate(ratings):
            reach *= rating
            gain += reach
            net = gain - (self._verify(j + 2) - base) * bought
            if net > best:
                keep, best = j + 1, net
        self._cut_in_a_row = self._cut_in_a_row + 1 if keep == 0 and confidence else 0
        if self._cut_in_a_row > PROBE_FIRST:
            keep, self._cut_in_a_row = 1, 0
            self.probes += 1
        self._confidence = list(confidence[:keep])
        self._stopped = keep < len(confidence)
        self.candidates_cut += len(confidence) - keep
        self.cut_to_plain += keep == 0 and bool(confidence)  # (an empty proposal was not cut: no match)
        return keep

    def observe(self, asked: int, proposed: int, accepted: int, committed: int, draft_seconds: float,
                verify_seconds: float, other_seconds: float) -> None:
        """What the step did: ``asked`` candidates allowed, ``proposed`` drafted, ``accepted`` kept,
        ``committed`` tokens committed, and its measured times (which refine the curve)."""
        if not self.active:
            return
        self.steps += 1
        if asked:
            self.since_speculation = self._plain_ahead = 0  # a stretch's decision stands for plain steps only
        else:
            self.plain_steps += 1
            self.since_speculation += 1
        if not asked:  # a plain step: learned from when the next decision is weighed (``_catch_up``)
            self._deferred.append((self._step_context, len(self._tokens) - 1, committed, verify_seconds, other_seconds))
            return
        self._catch_up()
        self._learn(asked, proposed, accepted, committed, draft_seconds, verify_seconds, other_seconds,
                    len(self._tokens) - 1)

    def _catch_up(self) -> None:
        """Learn from the plain steps the fast path took, in order, as ``observe`` would have then."""
        if not self._deferred:
            return
        deferred, self._deferred, chosen_at = self._deferred, [], self._step_context
        self._forget(len(deferred))
        for context, now, committed, verify_seconds, other_seconds in deferred:
            self._step_context = context
            self._prediction = (1.0, self.cost(0, context))
            self._learn_costs(0, committed, 0.0, verify_seconds, other_seconds, now)
        self._step_context = chosen_at

    def _forget(self, steps: int = 1) -> None:
        """Every step forgets (plain ones too): the acceptance counts, and what the stop's steps achieved
        (after a plain stretch a probe of them outweighs what they achieved long ago)."""
        self.acceptance.forget(steps)
        self._stop_tokens *= DECAY ** steps
        self._stop_seconds *= DECAY ** steps

    def _learn(self, asked: int, proposed: int, accepted: int, committed: int, draft_seconds: float,
               verify_seconds: float, other_seconds: float, context: int) -> None:
        """``observe``'s updates of the estimates, prices and predictions (``context``: positions
        cached after the step)."""
        # A proposal shorter than asked that was kept whole ended the chain there (prompt lookup's match
        # ran out; a drafter with nothing to propose): that position counts as a rejection, unless the
        # draft-side stop chose to end it.
        chain_ended = accepted == proposed < asked and not self._stopped
        stop_chose = self._stop_step and (proposed or self._stopped)
        # the acceptance by each candidate's confidence, as the estimates stood when it was drafted
        kept = self.acceptance.by_confidences(self._confidence[:proposed]) if stop_chose else []
        self._forget()
        if stop_chose:
            # The stop chose the length: predict the step from the proposal as drafted, and price it at
            # what it holds (a proposal ``cut`` to nothing: a plain step).
            self._prediction = (chain_tokens(kept, proposed)[-1], self.cost(proposed, self._step_context))
            # What such steps achieve, in the seconds they really took (self-correcting where the curve
            # prices a proposal too cheaply).
            self._stop_tokens += committed
            self._stop_seconds += draft_seconds + verify_seconds + other_seconds
        elif self._stop_step and asked and not proposed:  # nothing to propose: a plain step, predicted as one
            self._prediction = (1.0, self.cost(0, self._step_context))
        if asked:
            self.asked = DECAY * self.asked + 1
            self.answered = DECAY * self.answered + (proposed > 0 or self._stopped)  # cut to nothing: it proposed
            if proposed and not self._stop_step and not self._stopped:  # a stop's length says nothing of reach
                self.lengths.observe(asked, proposed)
        if proposed or not asked:  # (nothing proposed although asked, or all cut: nothing judged)
            self.acceptance.observe(proposed + chain_ended, accepted, self._confidence or None, forget=False)
            self.judged += min(proposed + chain_ended, accepted + 1)
        self._learn_costs(proposed, committed, draft_seconds, verify_seconds, other_seconds, context)

    def _learn_costs(self, proposed: int, committed: int, draft_seconds: float, verify_seconds: float,
                     other_seconds: float, context: int) -> None:
        """The step's predicted and measured seconds summed, and the prices' drift."""
        curve = self.curve
        plain = self.cost(0, context)
        tokens, seconds = self._prediction
        self.predicted_plain_seconds += plain * tokens
        self.predicted_seconds += seconds
        self.committed_plain_seconds += plain * committed
        self.actual_seconds += draft_seconds + verify_seconds + other_seconds
        # Track drift (a longer context, a busier machine) with one factor per curve: the measured shape
        # is kept, so a K rarely run is never judged by stale or noisy numbers of its own. The draft's
        # factor is relative to verification's: where drafts are rare (a run mostly plain), they are priced
        # at the machine's drift, not at the calibration's moment (layer skip drafting 0.95 of a step,
        # priced so on a machine then 10% slower, looked as if it paid, and ran 19 steps at 0.86x).
        rows = proposed + 1
        if rows <= CURVE_ROWS:
            self.verify_scale = _drift(self.verify_scale, verify_seconds / self._price(rows, self._step_context))
            self.row_cost.observe(rows, verify_seconds / self.verify_scale, curve.verify_at(rows, self._step_context),
                                  curve.verify[0])
        if 0 < proposed <= K_MAX and curve.draft[proposed] > 0:
            self.draft_scale = _drift(self.draft_scale, draft_seconds / (curve.draft[proposed] * self.verify_scale))
        curve.overhead = other_seconds if not self._costs_learned else 0.9 * curve.overhead + 0.1 * other_seconds
        self._costs_learned += 1

    def report(self) -> dict[str, Any]:
        """What the controller chose and why, for ``result.stats``."""
        self._catch_up()
        out: dict[str, Any] = {
            "k_mode": f"auto:{self.mode}",
            "calibration_seconds": self.calibration_seconds,
            "plain_steps": self.plain_steps,
            "probes": self.probes,
            "warmup_steps": self.warmup_steps,
            "candidates_cut": self.candidates_cut,
            "cut_to_plain": self.cut_to_plain,
            "prior_acceptance": None if self.prior_runs_rate is None else round(self.prior_runs_rate, 4),
            "acceptance_estimates": [round(a, 4) for a in self.acceptance.alphas()],
            "cost_curve": ({**self.curve.as_dict(), "verify_scale": round(self.verify_scale, 4),
                            "row_extra_seconds": round(self.row_cost.extra, 7),
                            "draft_scale": round(self.draft_scale, 4)} if self.curve is not None else None),
            "predicted_speedup": self.predicted_plain_seconds / self.predicted_seconds if self.predicted_seconds else None,
            "measured_speedup": self.committed_plain_seconds / self.actual_seconds if self.actual_seconds else None,
        }
        if self.failed:
            out["auto_fallback"] = self.failed
        return out
