"""The decoder behind the server: one worker thread decodes admitted requests one at a time.

Requests are checked completely before they are admitted (prompt, context, sampling, drafter, rule),
so a bad request costs no model work. Admitted requests wait in a bounded queue; when it is full the
server answers 429 with an estimate of when to retry. The worker runs each request's ``Generation``
step by step and hands every ``Step`` to the request's own asyncio queue, so no request can see
another's tokens. A request whose client went away is dropped from the queue, or stops at the next
decode step. Between requests nothing carries over but the models and the drafters' per-target plans
(a drafter's ``start`` resets its per-run state).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import threading
import time
import uuid
from typing import Any

from verispec.acceptance import parse_rule
from verispec.decoding import Generation, GenerationResult, Step, encode_messages, encode_prompt
from verispec.drafters.registry import DrafterChoice, ModelLoader, parse_drafter
from verispec.drafters.self_speculative import require_native
from verispec.errors import VerispecError
from verispec.sampling import SamplingConfig
from verispec.server.metrics import Metrics

log = logging.getLogger(__name__)

MAX_CACHED_DRAFTERS = 16  # per-request drafters kept built (layer plans); the server's own is always kept


class RequestError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-style message."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


@dataclasses.dataclass(frozen=True)
class Event:
    """What the worker tells a request: a ``Step``, the final result, or an error."""

    kind: str  # "step", "done" or "error"
    step: Step | None = None
    result: GenerationResult | None = None
    status: int = 500
    message: str = ""


@dataclasses.dataclass
class Job:
    """One admitted request."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    stop: list[str]
    choice: DrafterChoice | None
    acceptance: str
    loop: asyncio.AbstractEventLoop
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:24])
    admitted: float = dataclasses.field(default_factory=time.perf_counter)
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def emit(self, event: Event) -> None:
        """Called from the worker thread: hand ``event`` to the request's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
            pass


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_queue: int = 64  # admitted requests that may wait (the one being decoded not counted)
    default_max_tokens: int = 512  # when a chat request gives no max_tokens (capped by the context)
    acceptance: str = "exact"  # the server's rule when a request names none


class Engine:
    """The target, the server's drafter, the admission queue and the worker thread."""

    def __init__(self, target: Any, model_name: str, choice: DrafterChoice | None, load: ModelLoader | None,
                 config: EngineConfig = EngineConfig(), metrics: Metrics | None = None) -> None:
        self.target, self.model_name, self.choice, self.config = target, model_name, choice, config
        self.metrics = metrics or Metrics()
        self.context = target.config.max_position_embeddings
        parse_rule(config.acceptance)
        # Built drafters by (name, params): the server's own, then per-request ones (least recently used last).
        self._drafters: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self._default_key = self._key(choice) if choice is not None else None
        if choice is not None:
            self._drafters[self._default_key] = choice.build(load)
        self._queue: collections.deque[Job] = collections.deque()
        self._lock = threading.Condition(threading.RLock())
        self._running: Job | None = None
        self._stopping = False
        self._draining = False
        self._cut_at: float | None = None  # when draining: in-flight work ends at this time
        self._mean_seconds = 5.0  # moving average of a request's decode time, for Retry-After
        self._worker = threading.Thread(target=self._work, name="verispec-decoder", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ checking a request

    @staticmethod
    def _key(choice: DrafterChoice) -> tuple:
        return (choice.name, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in choice.params.items())))

    def drafter_choice(self, drafter: str | None, k: int | None) -> DrafterChoice | None:
        """The request's drafter: the server's (``None``), plain decoding (``"none"``) or a spec."""
        if drafter is None:
            choice = self.choice
        elif drafter.strip().lower() in ("none", "plain"):
            choice = None
        else:
            try:
                choice = parse_drafter(drafter, files=False)
            except VerispecError as exc:
                raise RequestError(400, str(exc), "verispec.drafter") from None
            if not choice.spec.per_request and self._key(choice) != self._default_key:
                served = self.choice.as_text() if self.choice is not None else "none"
                raise RequestError(400, f"drafter '{choice.name}' needs a model load, factorisation or quantized "
                                        f"copy, so it is available only as the server was started with it "
                                        f"(this server: {served}); start the server with it",
                                   "verispec.drafter")
        if k is not None:
            if choice is None:
                raise RequestError(400, "verispec.k sets the candidate length of a drafter; this request decodes "
                                        "without one", "verispec.k")
            choice = dataclasses.replace(choice, k=k)
        return choice

    def _drafter(self, choice: DrafterChoice) -> Any:
        """The built drafter for ``choice`` (K aside), built and checked against the target on first use."""
        key = self._key(choice)
        with self._lock:  # the request handlers and the worker both look drafters up
            drafter = self._drafters.get(key)
            if drafter is None:
                drafter = choice.build()
                if hasattr(drafter, "plan_for"):  # self-speculative: check its layers against the target now
                    drafter.plan_for(require_native(self.target, choice.name))
                self._drafters[key] = drafter
                while len(self._drafters) > MAX_CACHED_DRAFTERS + 1:
                    del self._drafters[next(k for k in self._drafters if k != self._default_key)]
            self._drafters.move_to_end(key)
            return drafter

    def check(self, prompt_ids: list[int], max_tokens: int | None, sampling: SamplingConfig, stop: list[str],
              choice: DrafterChoice | None, acceptance: str | None, loop: asyncio.AbstractEventLoop) -> Job:
        """A request, checked against the model: a ``Job`` ready to submit, or ``RequestError``."""
        if not prompt_ids:
            raise RequestError(400, "the prompt is empty", "prompt")
        room = self.context - len(prompt_ids)
        if max_tokens is None:
            max_tokens = min(self.config.default_max_tokens, room)
        if max_tokens < 1 or len(prompt_ids) + max_tokens > self.context:
            raise RequestError(400, f"this model's context is {self.context} tokens; the prompt has "
                                    f"{len(prompt_ids)} and max_tokens asks for {max_tokens}: reduce the prompt "
                                    "or max_tokens", "max_tokens", "context_length_exceeded")
        rule = acceptance or self.config.acceptance
        try:
            parse_rule(rule)
            if choice is not None:
                self._drafter(choice)  # built and checked now, not at the first decode step
        except VerispecError as exc:
            raise RequestError(400, str(exc), "verispec") from None
        return Job(prompt_ids, max_tokens, sampling, stop, choice, rule, loop)

    # ------------------------------------------------------------------ admission

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._draining or self._stopping:
                raise RequestError(503, "the server is shutting down", code="shutting_down")
            if len(self._queue) >= self.config.max_queue:
                self.metrics.rejected.inc()
                wait = (len(self._queue) + 1) * self._mean_seconds
                raise RequestError(429, f"the server is busy ({len(self._queue)} requests waiting); retry later",
                                   code="queue_full", headers={"Retry-After": str(max(1, min(600, math.ceil(wait))))})
            self._queue.append(job)
            self.metrics.queue_depth.set(len(self._queue))
            self._lock.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job if it still waits; otherwise the worker stops it at the next step."""
        if job.cancelled.is_set():
            return
        job.cancelled.set()
        with self._lock:
            try:
                self._queue.remove(job)
            except ValueError:
                pass
            self.metrics.queue_depth.set(len(self._queue))
        self.metrics.cancelled.inc()

    def load(self) -> dict[str, int]:
        with self._lock:
            return {"waiting": len(self._queue), "running": int(self._running is not None),
                    "max_queue": self.config.max_queue}

    # ------------------------------------------------------------------ shutdown

    def drain(self, grace_seconds: float) -> None:
        """Stop admitting; answer waiting requests 503; let the running one finish within ``grace_seconds``."""
        with self._lock:
            self._draining = True
            self._cut_at = time.perf_counter() + grace_seconds
            waiting, self._queue = list(self._queue), collections.deque()
            self.metrics.queue_depth.set(0)
        for job in waiting:
            job.emit(Event("error", status=503, message="the server is shutting down; this request was not started"))
        log.info("draining: %d waiting requests refused, %s running (ends within %.0f s)", len(waiting),
                 "one" if self._running else "none", grace_seconds)

    @property
    def default_drafter(self) -> Any:
        """The server's own drafter, built (None: plain decoding)."""
        return self._drafters.get(self._default_key) if self._default_key is not None else None

    @property
    def draining(self) -> bool:
        return self._draining

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._worker.join(timeout)

    # ------------------------------------------------------------------ the worker

    def _next(self) -> Job | None:
        with self._lock:
            while not self._queue and not self._stopping:
                self._lock.wait()
            if self._stopping:
                return None
            job = self._running = self._queue.popleft()
            self.metrics.queue_depth.set(len(self._queue))
            self.metrics.running.set(1)
            return job

    def _work(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            try:
                self._run(job)
            except Exception:  # never let one request take the worker down
                log.exception("request %s failed", job.id)
                job.emit(Event("error", status=500, message="internal error while decoding; see the server log"))
            finally:
                with self._lock:
                    self._running = None
                    self.metrics.running.set(0)

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        drafter = None
        if job.choice is not None:
            drafter = self._drafter(job.choice)
            drafter.k = job.choice.k  # the request's K (jobs run one at a time, so this is theirs alone)
        try:
            run = Generation(self.target, input_ids=job.prompt_ids, max_new_tokens=job.max_new_tokens,
                             sampling=job.sampling, drafter=drafter, stop=job.stop, acceptance=job.acceptance)
            first = None
            for step in run:
                first = first if first is not None else time.perf_counter() - job.admitted
                job.emit(Event("step", step=step))
                if job.cancelled.is_set():
                    log.info("request %s: client went away after %d tokens", job.id, run.stats.new_tokens)
                    return
                if self._cut_at is not None and time.perf_counter() > self._cut_at:
                    job.emit(Event("error", status=503, message="the server is shutting down; this request was "
                                                                f"cut after {run.stats.new_tokens} tokens"))
                    return
            result = run.result()
        except VerispecError as exc:
            job.emit(Event("error", status=500, message=str(exc)))
            return
        total = time.perf_counter() - job.admitted
        self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * result.stats.wall_seconds
        self.metrics.record_run(result.stats, first or total, total)
        job.emit(Event("done", result=result))


def token_ids(target: Any, text: str | None = None, messages: list[dict[str, str]] | None = None) -> list[int]:
    """A completion prompt, or chat messages through the model's template, encoded as ``verispec.generate``
    encodes them (the same functions: a seeded request must give generate's tokens)."""
    try:
        return encode_prompt(target, text) if messages is None else encode_messages(target, messages)
    except VerispecError as exc:
        raise RequestError(400, str(exc), "prompt" if messages is None else "messages") from None


def finish_reason(reason: str | None) -> str | None:
    """verispec's finish reasons in OpenAI's words: EOS and stop strings are both "stop"."""
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(reason or "", reason)


def usage(result: GenerationResult) -> dict[str, int]:
    n_prompt, n_new = len(result.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new}


def speculation(result: GenerationResult, return_token_ids: bool) -> dict[str, Any]:
    """The ``verispec`` block of a response: what speculation did for this request."""
    s = result.stats
    block = {"method": s.method, "k": s.k, "exact": s.exact, "acceptance_rule": s.settings.get("acceptance", "exact"),
             "settings": s.settings, "sampling": s.sampling, "seed": s.seed,
             "target_calls": s.target_calls, "draft_calls": s.draft_calls, "drafted_tokens": s.drafted_tokens,
             "accepted_tokens": s.accepted_tokens, "acceptance_rate": s.acceptance_rate,
             "acceptance_rate_by_position": s.acceptance_rate_by_position,
             "mean_accepted_length": s.mean_accepted_length, "wall_seconds": round(s.wall_seconds, 4),
             "prefill_seconds": round(s.prefill_seconds, 4), "tokens_per_second": round(s.tokens_per_second, 2),
             "quantization": s.settings.get("quantization"),
             "k_histogram": {str(k): n for k, n in (s.k_histogram or {}).items()}}
    if s.predicted_speedup is not None:  # k="auto": the controller's account
        block.update(plain_steps=s.plain_steps, probes=s.probes, predicted_speedup=round(s.predicted_speedup, 3),
                     measured_speedup=round(s.measured_speedup, 3), acceptance_estimates=s.acceptance_estimates)
    if return_token_ids:
        block["token_ids"] = list(result.token_ids)
    return block
