"""``verispec serve``: an OpenAI-compatible HTTP server with speculative decoding and per-request metrics.

``serve(ServeConfig())`` loads the models, warms them up (kernels compile, drafters build their
plans), then serves until SIGTERM or Ctrl-C. ``create_app(engine)`` is the ASGI app alone, for tests
and for embedding in another ASGI server.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket
import threading
from typing import Any, Callable

import uvicorn

from verispec.drafters.registry import DrafterChoice
from verispec.errors import VerispecError
from verispec.server.app import create_app
from verispec.server.engine import Engine, EngineConfig, RequestError

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "RequestError", "ServeConfig", "build_engine", "create_app", "is_loopback",
           "listen", "serve"]


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    model: str = "smollm2-135m"
    dtype: str = "bfloat16"
    backend: str = "native"
    quantize: str | None = None
    threads: int | None = None
    drafter: DrafterChoice | None = None
    acceptance: str = "exact"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    engine: EngineConfig = EngineConfig()
    shutdown_seconds: float = 30.0  # SIGTERM: the running request may finish within this, then it is cut
    warmup: bool = True


def build_engine(config: ServeConfig) -> Engine:
    """Load the target and the drafter, warm them up, and start the decoder thread."""
    from verispec.commands import set_threads
    from verispec.decoding import Generation
    from verispec.models.loading import load_model

    set_threads(config.threads)
    target = load_model(config.model, dtype=config.dtype, backend=config.backend, quantize=config.quantize)
    load: Callable[..., Any] = lambda name, quantize=None: load_model(name, dtype=config.dtype,
                                                                      backend=config.backend, quantize=quantize)
    engine = Engine(target, str(config.model), config.drafter, load,
                    dataclasses.replace(config.engine, acceptance=config.acceptance))
    if config.warmup:  # compile kernels, build the drafter's plan: the first client should not pay for it
        drafter = engine.default_drafter
        ids = list(target.tokenizer.encode("def hello():")) if target.tokenizer is not None else [1, 2, 3]
        Generation(target, input_ids=ids, max_new_tokens=8, drafter=drafter, ignore_eos=True).result()
    return engine


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """A bound socket for ``host:port`` (port 0: any free one), or a ``VerispecError`` saying why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise VerispecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def serve(config: ServeConfig, on_ready: Callable[[str], None] = lambda url: None) -> None:
    """Serve until SIGTERM / Ctrl-C: waiting requests are then refused (503), the running one may finish
    within ``config.shutdown_seconds`` and is cut cleanly after that."""
    sock = listen(config.host, config.port)  # before loading models: a busy port fails at once
    if not is_loopback(config.host) and not config.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the server",
                    config.host)
    engine = build_engine(config)
    app = create_app(engine, config.api_key)
    quiet = logging.getLogger("verispec").getEffectiveLevel() > logging.INFO
    server = _Server(uvicorn.Config(app, log_level="warning" if quiet else "info",
                                    timeout_graceful_shutdown=int(config.shutdown_seconds) + 5,
                                    timeout_keep_alive=5), engine, config.shutdown_seconds)
    host, port = sock.getsockname()[:2]
    on_ready(f"http://{'[' + host + ']' if ':' in host else host}:{port}")
    server.run(sockets=[sock])


class _Server(uvicorn.Server):
    """uvicorn's server, told to drain the engine at the first SIGTERM / Ctrl-C."""

    def __init__(self, config: uvicorn.Config, engine: Engine, grace: float) -> None:
        super().__init__(config)
        self.engine, self.grace = engine, grace

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:  # in a thread: the signal may arrive while the loop holds the engine's lock
            threading.Thread(target=self.engine.drain, args=(self.grace,), daemon=True).start()
        super().handle_exit(sig, frame)
