"""The HTTP layer: OpenAI-compatible routes over the ``Engine`` (FastAPI on uvicorn).

Every error answers an OpenAI error object (``{"error": {"message", "type", "param", "code"}}``) with
a status that says whose fault it was: 400 for a bad request (checked before any model work), 401
for a missing or wrong API key, 413 for an oversized body, 429 (with ``Retry-After``) when the queue
is full, 503 while shutting down, 500 for the server's own failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec import __version__
from verispec.errors import VerispecError
from verispec.sampling import SamplingConfig
from verispec.server.engine import (Engine, Event, Job, RequestError, finish_reason, speculation, token_ids,
                                    usage)
from verispec.server.protocol import ChatRequest, CompletionRequest, error_body

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 2**20  # a prompt larger than any context this runtime holds, in JSON
DISCONNECT_POLL_SECONDS = 0.5  # how often a waiting request checks that its client is still there
PROTECTED = ("/v1/", "/metrics")  # what --api-key guards (/health stays open for liveness probes)


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's errors as one readable line, and the first offending field."""
    parts, param = [], None
    for error in exc.errors():
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or where or None
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        if error.get("type") == "extra_forbidden":
            message = "unknown field (not part of this API)"
        elif not loc and error.get("type") in ("model_attributes_type", "dict_type"):
            message = "the request body must be a JSON object (send Content-Type: application/json)"
        elif error.get("type") == "json_invalid":
            message = f"the body is not valid JSON ({error.get('ctx', {}).get('error', 'parse error')})"
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts) or "invalid request", param


class _Guard:
    """ASGI middleware: body size limit, API key, and the request counter by endpoint and status."""

    def __init__(self, app: Any, engine: Engine, api_key: str | None) -> None:
        self.app, self.engine = app, engine
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status: list[int] = []

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        try:
            refusal = self._refusal(path, headers)
            if refusal is not None:
                return await refusal(scope, receive, counting_send)
            await self.app(scope, receive, counting_send)
        finally:
            endpoint = path if path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                        "/metrics") else "other"
            self.engine.metrics.requests.labels(endpoint, str(status[0] if status else 499)).inc()

    def _refusal(self, path: str, headers: dict[str, str]) -> Response | None:
        length = headers.get("content-length", "0")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            return _error(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB")
        if self.api_key is not None and path.startswith(PROTECTED):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            # Constant-time comparison: the time taken says nothing about how much of the key matched.
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                return _error(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                              code="invalid_api_key")
        return None


async def _events(engine: Engine, job: Job, request: Request) -> AsyncIterator[Event]:
    """The job's events until it ends; cancels the job when the client goes away."""
    finished = False
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            yield event
            if event.kind != "step":
                finished = True
                return
    finally:
        if not finished:
            engine.cancel(job)


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


class _Responder:
    """Builds the OpenAI response objects of one request (completion or chat, whole or streamed)."""

    def __init__(self, engine: Engine, chat: bool, body: CompletionRequest | ChatRequest) -> None:
        self.engine, self.chat, self.body = engine, chat, body
        self.created = int(time.time())

    def _head(self, job: Job, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + job.id, "object": kind, "created": self.created, "model": self.engine.model_name,
                "system_fingerprint": f"verispec-{__version__}"}

    def whole(self, job: Job, event: Event) -> dict[str, Any]:
        result = event.result
        reason = finish_reason(result.finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": reason}
        return {**self._head(job, False), "choices": [choice], "usage": usage(result),
                "verispec": speculation(result, self.body.verispec.return_token_ids)}

    def chunk(self, job: Job, text: str | None, reason: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return {**self._head(job, True), "choices": [choice]}

    async def stream(self, job: Job, request: Request) -> AsyncIterator[str]:
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        if self.chat:
            yield _sse(self.chunk(job, None, role=True))
        async for event in _events(self.engine, job, request):
            if event.kind == "step":
                if event.step.text:
                    yield _sse(self.chunk(job, event.step.text))
            elif event.kind == "done":
                result = event.result
                # The last chunk carries the finish reason, the usage and what speculation did.
                last = self.chunk(job, None, finish_reason(result.finish_reason))
                last["usage"] = usage(result)
                last["verispec"] = speculation(result, self.body.verispec.return_token_ids)
                yield _sse(last)
                if include_usage:  # OpenAI's separate usage chunk, with no choices
                    yield _sse({**self._head(job, True), "choices": [], "usage": usage(result)})
                yield _sse("[DONE]")
            else:
                yield _sse(error_body(event.message, "server_error", code=str(event.status)))
                yield _sse("[DONE]")


def create_app(engine: Engine, api_key: str | None = None) -> FastAPI:
    """The ASGI app serving ``engine``; ``api_key`` guards /v1/* and /metrics with a Bearer token."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.stop()

    app = FastAPI(title="verispec", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    started = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error(400, message, param)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _error(500, "internal server error; see the server log")

    async def serve(request: Request, body: CompletionRequest | ChatRequest, chat: bool) -> Response:
        ext = body.verispec
        if chat:
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in body.messages]
            ids, limit = token_ids(engine.target, messages=messages), body.token_limit
        else:
            ids, limit = token_ids(engine.target, text=body.prompt), body.max_tokens
        try:
            sampling = SamplingConfig(body.temperature, body.top_k, body.top_p, body.seed)
        except VerispecError as exc:
            raise RequestError(400, str(exc)) from None
        choice = engine.drafter_choice(ext.drafter, ext.k)
        job = engine.check(ids, limit, sampling, body.stop, choice, ext.acceptance, asyncio.get_running_loop())
        engine.submit(job)
        responder = _Responder(engine, chat, body)
        if body.stream:
            return StreamingResponse(responder.stream(job, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for event in _events(engine, job, request):
            if event.kind == "done":
                return JSONResponse(responder.whole(job, event))
            if event.kind == "error":
                return _error(event.status, event.message)
        return Response(status_code=499)  # the client went away; nobody reads this

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serve(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        return await serve(request, body, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        drafter = engine.choice.as_text() if engine.choice is not None else "none"
        return {"object": "list", "data": [{
            "id": engine.model_name, "object": "model", "created": started, "owned_by": "verispec",
            "verispec": {"drafter": drafter, "context": engine.context, "acceptance": engine.config.acceptance,
                         "quantization": getattr(engine.target, "quantization", None),
                         "dtype": str(getattr(engine.target, "dtype", "")).removeprefix("torch.") or None}}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        load = engine.load()
        draining = engine.draining
        return JSONResponse({"status": "draining" if draining else "ok", "model": engine.model_name, **load},
                            status_code=503 if draining else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_middleware(_Guard, engine=engine, api_key=api_key)
    return app
