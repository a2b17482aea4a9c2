"""The OpenAI-compatible request and response shapes, as pydantic models.

Requests are strict: an unknown field, a wrong type or a value out of range is a 400 with an OpenAI-style
error object, never silently ignored. OpenAI fields that verispec does not implement are accepted only
at their neutral value (``presence_penalty: 0``, ``logprobs: null``, ``n: 1``) and refused otherwise,
so a client never gets an answer computed under settings it did not ask for.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from verispec.adaptive import parse_k
from verispec.errors import VerispecError

MAX_STOPS = 4  # as OpenAI


class Extension(BaseModel):
    """``"verispec": {...}`` in a request: the draft source, K and acceptance rule for this request."""

    model_config = ConfigDict(extra="forbid")

    drafter: str | None = Field(None, description="'none' (plain decoding), or a drafter spec "
                                                  "NAME:key=value,... (`verispec drafters`); default: the server's")
    k: int | str | None = Field(None, description="Candidate length K (1..64), or 'auto' (chosen per step from "
                                                  "measured costs)")
    acceptance: str | None = Field(None, description="exact (default), lenient:L, typical:EPS[,DELTA], topk:K")
    return_token_ids: bool = Field(False, description="Add the generated token ids to the response")

    @field_validator("k", mode="before")
    @classmethod
    def _k(cls, k: Any) -> int | str | None:
        if k is None:
            return None
        try:
            k = parse_k(k, "k")
        except VerispecError as exc:
            raise ValueError(str(exc)) from None
        if isinstance(k, int) and k > 64:
            raise ValueError(f"k must be at most 64, got {k}")
        return k


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # the server serves one model; any name (or none) selects it
    temperature: float = Field(1.0, ge=0.0, le=100.0)  # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # extension (llama.cpp, vLLM): 0 is off
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as an identifier for the client's own use
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    verispec: Extension = Field(default_factory=Extension)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n = 1 is supported: one choice per request (send separate requests)")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("repetition penalties are not supported (they would change the target's "
                             "distribution that speculative decoding preserves); send 0 or omit it")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported; send {} or omit it")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops


class CompletionRequest(_Common):
    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str:
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("one prompt per request (a list must hold exactly one string)")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        for name, neutral in (("echo", False), ("logprobs", None), ("suffix", None)):
            if getattr(self, name) != neutral:
                raise ValueError(f"'{name}' is not supported; omit it")
        if self.best_of not in (None, 1):
            raise ValueError("only best_of = 1 is supported")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False

    @model_validator(mode="after")
    def _unsupported(self) -> "ChatRequest":
        if self.logprobs:
            raise ValueError("'logprobs' is not supported; omit it")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
