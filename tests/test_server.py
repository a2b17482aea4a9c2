"""`verispec serve`: the OpenAI-compatible server, tested through the official `openai` client and raw HTTP.

Servers run in a thread of the test process on a free port (tiny models made in the tests); the
SIGTERM test runs `verispec serve` as a real process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

from verispec import DraftModel, SamplingConfig, generate, load_model  # noqa: E402
from verispec.drafters import make_choice  # noqa: E402
from verispec.server import EngineConfig, ServeConfig, build_engine, create_app, listen  # noqa: E402
from verispec.server.engine import Engine  # noqa: E402

K = 3
API_KEY = "s3cret-key"


class Running:
    """A server on a free port, in a thread of this process."""

    def __init__(self, engine: Engine, api_key: str | None = None) -> None:
        import uvicorn

        self.engine = engine
        sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(engine, api_key), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)

    def client(self, key: str = "unused", **kwargs) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kwargs)

    def post(self, path: str, body=None, **kwargs) -> "httpx.Response":
        return httpx.post(self.url + path, json=body, timeout=60, **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class Slow:
    """A target whose every forward pass takes at least ``delay`` seconds: requests that last long enough
    to be queued behind, cancelled or cut, whatever the machine's speed."""

    def __init__(self, model, delay: float) -> None:
        self.model, self.delay = model, delay
        self.config, self.tokenizer, self.name, self.folder = model.config, model.tokenizer, model.name, model.folder

    def new_cache(self, capacity: int):
        return self.model.new_cache(capacity)

    def forward(self, input_ids, cache, start, last_only=False):
        time.sleep(self.delay)
        return self.model.forward(input_ids, cache, start, last_only)


@pytest.fixture(scope="module")
def server(tiny_chat_pair):
    """The tiny target with the tiny draft model as the server's drafter (K = 3)."""
    target, draft = tiny_chat_pair
    config = ServeConfig(model=str(target), dtype="float32",
                         drafter=make_choice("draft-model", {"draft": str(draft)}, K))
    running = Running(build_engine(config))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def slow_server(tiny_chat_pair):
    """Plain decoding at >= 20 ms per token, one request waiting at most, an API key."""
    model = load_model(str(tiny_chat_pair[0]), dtype="float32")
    engine = Engine(Slow(model, 0.02), "slow", None, None, EngineConfig(max_queue=1))
    running = Running(engine, api_key=API_KEY)
    yield running
    running.stop()


def _error(response: "httpx.Response", status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error
    return error


# ---------------------------------------------------------------------------------------- answers

def test_completion_matches_verispec_generate_with_the_same_seed(server, tiny_chat_pair):
    """Same seed and settings, same tokens: the server adds nothing to, and loses nothing from, a run."""
    reference_target = load_model(str(tiny_chat_pair[0]), dtype="float32")
    draft = load_model(str(tiny_chat_pair[1]), dtype="float32")
    for seed, temperature, top_k in ((7, 0.8, 20), (8, 1.3, 0)):
        response = server.client().completions.create(
            model="any", prompt="def add(a, b):", max_tokens=40, temperature=temperature, seed=seed,
            extra_body={"top_k": top_k, "verispec": {"return_token_ids": True}})
        expected = generate(reference_target, "def add(a, b):", max_new_tokens=40, drafter=DraftModel(draft, k=K),
                            sampling=SamplingConfig(temperature, top_k, 1.0, seed))
        block = response.model_extra["verispec"]
        assert block["token_ids"] == expected.token_ids
        assert response.choices[0].text == expected.text
        assert response.choices[0].finish_reason == ("length" if expected.finish_reason == "length" else "stop")
        assert block["seed"] == seed and block["method"] == "draft-model" and block["k"] == K
        assert block["exact"] is True and block["drafted_tokens"] > 0
        assert response.usage.completion_tokens == len(expected.token_ids)
        assert response.usage.prompt_tokens == len(expected.prompt_ids)


def test_chat_matches_generate_with_the_chat_template(server, tiny_chat_pair):
    target = load_model(str(tiny_chat_pair[0]), dtype="float32")
    response = server.client().chat.completions.create(
        model="any", messages=[{"role": "user", "content": "guten Tag"}], max_tokens=24, temperature=0,
        extra_body={"verispec": {"drafter": "none", "return_token_ids": True}})
    expected = generate(target, "guten Tag", max_new_tokens=24, chat=True)
    assert response.model_extra["verispec"]["token_ids"] == expected.token_ids
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].message.role == "assistant"
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.model_extra["verispec"]["method"] == "plain"


def test_streaming_gives_the_same_text_and_ends_with_the_speculation_report(server):
    client = server.client()
    args = dict(model="any", prompt="the cat sat", max_tokens=30, temperature=0.9, seed=3)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    report = finals[0].model_extra["verispec"]
    assert report["target_calls"] == whole.model_extra["verispec"]["target_calls"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    chat = list(client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=12, seed=1, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason in ("stop", "length")
    assert "verispec" in chat[-1].model_extra and chat[-1].usage is not None


def test_raw_stream_is_server_sent_events_ending_with_done(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "the cat", "max_tokens": 8, "stream": True, "seed": 1}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert len({p["id"] for p in payloads}) == 1


def test_stop_strings_cut_the_text_and_never_stream_part_of_a_stop(server):
    client = server.client()
    args = dict(model="any", prompt="def add(a, b):", max_tokens=40, temperature=0,
                extra_body={"verispec": {"drafter": "none"}})
    full = client.completions.create(**args).choices[0].text
    assert len(full) > 12
    stop = full[6:9]  # three characters that appear mid-output (maybe across tokens)
    cut = client.completions.create(**args, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stop=stop, stream=True))
    assert streamed == cut.choices[0].text


def test_per_request_drafter_k_and_rule(server):
    client = server.client()
    cases = [({"drafter": "prompt-lookup:ngram=1", "k": 2}, "prompt-lookup", 2, True),
             ({"drafter": "layer-skip:skip=1"}, "layer-skip", "auto", True),  # the default K
             ({"k": 5}, "draft-model", 5, True),
             ({"k": "auto"}, "draft-model", "auto", True),
             ({"acceptance": "lenient:0.5"}, "draft-model", K, False)]
    for ext, method, k, exact in cases:
        response = client.completions.create(model="any", prompt="the cat sat on", max_tokens=12, temperature=0.7,
                                             seed=2, extra_body={"verispec": ext})
        block = response.model_extra["verispec"]
        assert (block["method"], block["k"], block["exact"]) == (method, k, exact), ext
        assert block["target_calls"] >= 1 and block["wall_seconds"] > 0
        assert sum(block["k_histogram"].values()) == block["target_calls"] - 1
        assert ("predicted_speedup" in block) == (k == "auto")


def test_models_health_and_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.engine.model_name]
    assert models.data[0].model_extra["verispec"]["drafter"].startswith("draft-model:")
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["max_queue"] == 64
    server.client().completions.create(model="any", prompt="the cat", max_tokens=10, seed=5)
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        match = re.match(r'^(verispec_\w+)\{method="draft-model"(?:,position="0")?\} ([0-9.e+]+)$', line)
        if match:
            values[match.group(1)] = float(match.group(2))
    for name in ("verispec_generation_tokens_total", "verispec_target_calls_total", "verispec_drafted_tokens_total",
                 "verispec_accepted_tokens_by_position_total", "verispec_time_to_first_token_seconds_count",
                 "verispec_time_per_output_token_seconds_count", "verispec_mean_accepted_length"):
        assert name in values, name
    assert values["verispec_generation_tokens_total"] >= 10
    assert 'verispec_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert "process_resident_memory_bytes" in text


# ---------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens", ["integer"]),
    ({"prompt": "x", "temperature": -1}, "temperature", ["greater than or equal to 0"]),
    ({"prompt": "x", "top_p": 0}, "top_p", ["greater than 0"]),
    ({"prompt": "x", "top_k": -2}, "top_k", []),
    ({"prompt": "x", "n": 2}, "n", ["n = 1"]),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", []),
    ({"prompt": ["a", "b"]}, "prompt", ["one prompt"]),
    ({"prompt": ""}, "prompt", ["empty"]),
    ({}, "prompt", ["Field required"]),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", ["not supported"]),
    ({"prompt": "x", "logprobs": 2}, None, ["logprobs"]),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", ["at most 4"]),
    ({"prompt": "x", "tools": []}, "tools", ["unknown field"]),
    ({"prompt": "x", "verispec": {"draft": "x"}}, "verispec.draft", ["unknown field"]),
    ({"prompt": "x", "verispec": {"k": 0}}, "verispec.k", []),
    ({"prompt": "x", "verispec": {"k": "fast"}}, "verispec.k", ["'auto'"]),
    ({"prompt": "x", "verispec": {"k": 65}}, "verispec.k", ["at most 64"]),
    ({"prompt": "x", "verispec": {"drafter": "warp-drive"}}, "verispec.drafter", ["unknown drafter"]),
    ({"prompt": "x", "verispec": {"drafter": "layer-skip:skip=/etc/passwd"}}, "verispec.drafter", ["settings files"]),
    ({"prompt": "x", "verispec": {"drafter": "layer-skip:skip=9"}}, "verispec", ["outside"]),
    ({"prompt": "x", "verispec": {"drafter": "low-rank:rank=4"}}, "verispec.drafter", ["as the server was started"]),
    ({"prompt": "x", "verispec": {"drafter": "draft-model:draft=/tmp/other"}}, "verispec.drafter", ["started"]),
    ({"prompt": "x", "verispec": {"drafter": "none", "k": 2}}, "verispec.k", ["without one"]),
    ({"prompt": "x", "verispec": {"acceptance": "maybe"}}, "verispec", ["unknown acceptance rule"]),
    ({"prompt": "x", "max_tokens": 100000}, "max_tokens", ["context"]),
    ({"prompt": "x " * 300, "max_tokens": 1}, "max_tokens", ["context"]),
])
def test_bad_completion_requests_answer_400_with_an_openai_error(server, body, param, words):
    error = _error(server.post("/v1/completions", body), 400, *words)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    if "context" in words:
        assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("body, words", [
    ({"messages": []}, ["at least 1"]),
    ({"messages": [{"role": "wizard", "content": "x"}]}, ["role"]),
    ({"messages": [{"role": "user"}]}, ["content"]),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, ["logprobs"]),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 3}, ["not both"]),
])
def test_bad_chat_requests_answer_400(server, body, words):
    _error(server.post("/v1/chat/completions", body), 400, *words)


def test_malformed_json_and_wrong_shapes_answer_400(server):
    headers = {"content-type": "application/json"}
    _error(httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x",', headers=headers), 400, "JSON")
    _error(httpx.post(server.url + "/v1/completions", content=b'[1, 2]', headers=headers), 400, "JSON object")
    _error(httpx.post(server.url + "/v1/completions", content=b'"text"', headers=headers), 400)


def test_the_openai_client_sees_typed_errors(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().completions.create(model="any", prompt="x", max_tokens=10**6)
    assert caught.value.status_code == 400 and "context" in str(caught.value)


def test_unknown_paths_and_methods_answer_openai_errors(server):
    _error(httpx.get(server.url + "/v1/engines"), 404)
    _error(httpx.get(server.url + "/v1/completions"), 405)


def test_oversized_body_answers_413(server):
    _error(server.post("/v1/completions", {"prompt": "x" * (5 * 2**20)}), 413, "larger than")


def test_api_key_guards_the_api_but_not_health(slow_server):
    body = {"prompt": "the", "max_tokens": 2}
    _error(slow_server.post("/v1/completions", body), 401, "API key")
    _error(slow_server.post("/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    _error(httpx.get(slow_server.url + "/metrics", headers={"Authorization": API_KEY}), 401)
    with pytest.raises(openai.AuthenticationError):
        slow_server.client("nope").completions.create(model="x", prompt="the", max_tokens=2)
    assert slow_server.client(API_KEY).completions.create(model="x", prompt="the", max_tokens=2).usage
    assert httpx.get(slow_server.url + "/health").status_code == 200


# ---------------------------------------------------------------------------------------- load and faults

def _metric(running: Running, name: str) -> float:
    text = httpx.get(running.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    match = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def _wait(condition, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_full_queue_answers_429_with_retry_after(slow_server):
    """One request decodes, one waits (max_queue = 1): a third is refused at once, the first two finish."""
    client = slow_server.client(API_KEY)
    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(client.completions.create, model="x", prompt="the", max_tokens=25, temperature=0)]
        assert _wait(lambda: slow_server.engine.load()["running"] == 1, 10)
        running.append(pool.submit(client.completions.create, model="x", prompt="the", max_tokens=25, temperature=0))
        assert _wait(lambda: slow_server.engine.load()["waiting"] == 1, 10)
        refused = slow_server.post("/v1/completions", {"prompt": "the", "max_tokens": 2},
                                   headers={"Authorization": f"Bearer {API_KEY}"})
        error = _error(refused, 429, "busy")
        assert error["type"] == "rate_limit_error" and int(refused.headers["retry-after"]) >= 1
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="x", prompt="the", max_tokens=2)
        texts = [f.result().choices[0].text for f in running]
    assert texts[0] == texts[1]  # both admitted requests were answered in full, neither disturbed


def test_client_that_disconnects_mid_stream_frees_its_slot(slow_server):
    cancelled = _metric(slow_server, "verispec_cancelled_requests_total")
    with httpx.stream("POST", slow_server.url + "/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"prompt": "the", "max_tokens": 200, "stream": True, "temperature": 0}) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert slow_server.engine.load()["running"] == 1
    # 200 tokens take >= 4 s; the slot frees at the next step after the server notices the client left.
    started = time.time()
    assert _wait(lambda: slow_server.engine.load()["running"] == 0, 2.5), "the worker kept decoding"
    assert time.time() - started < 2.5
    assert _metric(slow_server, "verispec_cancelled_requests_total") == cancelled + 1


def test_client_that_gives_up_while_queued_is_dropped(slow_server):
    client = slow_server.client(API_KEY)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.completions.create, model="x", prompt="the", max_tokens=60, temperature=0)
        assert _wait(lambda: slow_server.engine.load()["running"] == 1, 10)
        with pytest.raises(openai.APITimeoutError):
            slow_server.client(API_KEY, timeout=0.3).completions.create(model="x", prompt="a", max_tokens=5)
        assert _wait(lambda: slow_server.engine.load()["waiting"] == 0, 3)
        assert first.result().usage.completion_tokens == 60


def test_concurrent_clients_each_get_their_own_answer(server):
    """Eight clients with different seeds at once: every answer equals the same request made alone."""
    client = server.client()
    args = [dict(model="any", prompt=prompt, max_tokens=20, temperature=1.0, seed=seed,
                 extra_body={"verispec": {"return_token_ids": True}})
            for seed, prompt in enumerate(["the cat", "def add", "guten", "the mat"] * 2)]
    alone = [client.completions.create(**a).model_extra["verispec"]["token_ids"] for a in args]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda a: client.completions.create(**a).model_extra["verispec"]["token_ids"], args))
    assert together == alone


def test_sigterm_ends_in_flight_streams_cleanly_and_exits(tiny_chat_pair, tmp_path):
    """`verispec serve` as a process: SIGTERM while a stream runs ends it with [DONE] (finished, or cut with
    an error event), refuses new work, and the process exits without a traceback."""
    command = [sys.executable, "-m", "verispec.cli", "serve", "--model", str(tiny_chat_pair[0]), "--dtype",
               "float32", "--plain", "--port", "0", "--shutdown-timeout", "0"]
    process, url, log = _start(command)
    try:
        assert _wait(lambda: _reachable(url), 20)
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "the", "max_tokens": 240, "stream": True, "temperature": 1.0}) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert first.startswith("data: {")
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][6:])
        assert "error" in last and "shutting down" in last["error"]["message"] or \
            last["choices"][0]["finish_reason"] in ("stop", "length")
        assert process.wait(30) in (0, -signal.SIGTERM)
        assert "Traceback" not in log(), log()
    finally:
        if process.poll() is None:
            process.kill()


def _reachable(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_command_refuses_bad_flags_before_loading(tiny_chat_pair):
    from click.testing import CliRunner

    from verispec.cli import main

    for args, words in ((["--plain", "--prompt-lookup", "3"], "--plain"), (["-k", "3", "--plain"], "-k"),
                        (["--acceptance", "nope"], "unknown acceptance"), (["--port", "70000"], "70000")):
        result = CliRunner().invoke(main, ["serve", "--model", str(tiny_chat_pair[0]), *args])
        assert result.exit_code == 2, result.output
        assert words in result.output, result.output


def test_serve_reports_a_busy_port_in_one_line(tiny_chat_pair):
    from click.testing import CliRunner

    from verispec.cli import main

    taken = listen("127.0.0.1", 0)
    taken.listen(1)
    try:
        result = CliRunner().invoke(main, ["serve", "--model", str(tiny_chat_pair[0]), "--port",
                                           str(taken.getsockname()[1])])
    finally:
        taken.close()
    assert result.exit_code == 2 and "cannot listen" in result.output, result.output


def test_request_models_are_not_shared_between_requests(server):
    """A client's cancelled or failed request leaves nothing behind: the engine's queue is empty and the
    next answer is the same as before."""
    args = dict(model="any", prompt="the cat", max_tokens=16, temperature=0)
    before = server.client().completions.create(**args).choices[0].text
    server.post("/v1/completions", {"prompt": "x", "verispec": {"drafter": "layer-skip:skip=9"}})
    assert server.client().completions.create(**args).choices[0].text == before
    # the worker frees the request's slot just after the last bytes went out: give it a moment
    assert _wait(lambda: server.engine.load() == {"waiting": 0, "running": 0, "max_queue": 64}, 2.5), \
        server.engine.load()


def _start(command: list[str], deadline: float = 600) -> tuple[subprocess.Popen, str, Callable[[], str]]:
    """Start `verispec serve`; return the process, its address and a function giving its stderr so far.

    A thread reads stderr from the start: the pipe never fills (which would block the server mid-request),
    and a server that never prints its address fails the test after ``deadline`` seconds with what it
    wrote, instead of hanging the suite."""
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    address: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in process.stderr:
            lines.append(line)
            match = None if address else re.search(r"serving .* on (http://\S+)", line)
            if match:
                address.append(match.group(1))
                ready.set()
        ready.set()  # the stream ended: the process is gone

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def log() -> str:
        if process.poll() is not None:
            reader.join(30)
        return "".join(lines)

    if not ready.wait(deadline) or not address:
        if process.poll() is None:
            process.kill()
        code = process.wait()
        raise AssertionError(f"the server did not print its address within {deadline:.0f} s (exit code {code}):\n"
                             + log())
    return process, address[0], log


def test_default_serve_is_smollm2_with_the_cpus_weights_and_prompt_lookup_and_answers_like_generate(smollm2_folder):
    """`verispec serve` with its defaults (only the port chosen freely): the demo's configuration (int8 on a
    CPU where int8 decodes faster than bf16, else bf16), and its answer is verispec.generate's, token for token."""
    from verispec import PromptLookup
    from verispec.commands import default_quantize

    weights = default_quantize()

    process, url, _ = _start([sys.executable, "-m", "verispec.cli", "serve", "--port", "0"])
    try:
        assert _wait(lambda: _reachable(url), 60)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert client.models.list().data[0].model_extra["verispec"]["quantization"] == weights
        question = "Write a Python function that returns the sum of a list of numbers."
        reply = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": question}],
                                               max_tokens=32, temperature=0,
                                               extra_body={"verispec": {"return_token_ids": True}})
        block = reply.model_extra["verispec"]
        assert (block["method"], block["k"], block["quantization"]) == ("prompt-lookup", "auto", weights)
        target = load_model("smollm2-135m", quantize=weights, dtype="bfloat16")  # the server's defaults
        expected = generate(target, question, max_new_tokens=32, chat=True, drafter=PromptLookup(3))  # k="auto", the default
        assert block["token_ids"] == expected.token_ids
        assert reply.choices[0].message.content == expected.text
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
