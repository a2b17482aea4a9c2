"""``verispec report RESULTS``: the results of a benchmark as markdown, HTML and PNG plots."""

from __future__ import annotations

import html
import statistics
from pathlib import Path
from typing import Any

from verispec.bench.records import read_results, summarise
from verispec.errors import VerispecError

HEADER = ["method", "mode", "rule", "K", "runs", "acceptance", "mean accepted length", "target calls / token",
          "tok/s", "speedup (median [spread])", "after the first token", "quality vs plain"]
ROOFLINE = "share of read bandwidth"


def _f(value: Any, fmt: str = "{:.2f}") -> str:
    return "–" if value is None else fmt.format(value)


def _quality(s: dict[str, Any]) -> str:
    baseline = s["compared_with"] == s["setting"]
    if baseline:
        parts = [] if s["identical"] is not None else [f"log p {_f(s['target_logprob_mean'], '{:.3f}')}"]
    elif s["identical"] is not None:
        parts = [f"{s['identical']}/{s['runs']} identical"]
        if s["first_divergence_median"] is not None:
            parts.append(f"first divergence at token {s['first_divergence_median']:.0f} (median)")
    else:
        delta, se = s["logprob_delta"], s["logprob_delta_se"]
        parts = [f"Δ log p {_f(delta, '{:+.3f}')}" + (f" ± {2 * se:.3f}" if se is not None else "")]
    parts += _task_parts(s, baseline)
    if s["metric"] and s["metric_value"] is not None:
        name = {"chrf": "chrF", "rouge_l": "ROUGE-L"}[s["metric"]]
        parts.append(f"{name} {s['metric_value']:.1f}" + ("" if baseline else f" (plain {s['plain_metric_value']:.1f})"))
    return "; ".join(parts)


def _task_parts(s: dict[str, Any], baseline: bool) -> list[str]:
    """pass@1 and math accuracy with their 95% intervals, beside plain decoding's on the same prompts."""
    parts = []
    for key, name in (("pass", "pass@1"), ("accuracy", "answers correct")):
        if s.get(f"{key}_n"):
            text = f"{name} {s[f'{key}_rate']:.2f} [{s[f'{key}_low']:.2f}–{s[f'{key}_high']:.2f}] of {s[f'{key}_n']}"
            parts.append(text + ("" if baseline else f" (plain {s[f'plain_{key}_rate']:.2f})"))
    if s.get("pass_at_k"):
        parts.append(", ".join(f"pass@{k} {v:.2f}" for k, v in s["pass_at_k"].items()))
    return parts


def _row(s: dict[str, Any]) -> list[str]:
    baseline = s["compared_with"] == s["setting"]
    speed = "1.00 (baseline)" if baseline else (
        f"{s['speedup_median']:.2f} [{s['speedup_low']:.2f}–{s['speedup_high']:.2f}]")
    if s["compared_with"] not in ("plain", s["setting"]):  # another quantization's baseline
        speed += f" vs {s['compared_with']}"
    rule = s["acceptance"] if s["exact"] else f"**{s['acceptance']} (APPROXIMATE)**"
    label = s["setting"] if s["engine"] == "verispec" else f"{s['setting']} (transformers)"
    return [label, s["mode"], rule, str(s["k"] or "–"), str(s["runs"]), _f(s["acceptance_rate"], "{:.1%}"),
            _f(s["mean_accepted_length"]), _f(s["target_calls_per_token"], "{:.3f}"), _f(s["tokens_per_second"]),
            speed, "1.00" if baseline else _f(s.get("decode_speedup_median")), _quality(s),
            _f(s["roofline"], "{:.0%}")]


def tables(summaries: list[dict[str, Any]]) -> dict[str, list[list[str]]]:
    """Rows per workload under ``HEADER``; the roofline column only when some run measured it."""
    out: dict[str, list[list[str]]] = {}
    keep = len(HEADER) + any(s["roofline"] is not None for s in summaries)
    order = lambda s: (s["mode"] != "greedy", s["mode"], s["method"] != "plain", s["engine"], s["setting"])
    for s in sorted(summaries, key=lambda s: (s["workload"], *order(s))):
        out.setdefault(s["workload"], []).append(_row(s)[:keep])
    return out


AUTO_HEADER = ["method", "workload", "mode", "steps by K chosen", "steps without speculation",
               "predicted speedup", "measured", "achieved (vs plain run)"]


def auto_k_rows(summaries: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for s in sorted(summaries, key=lambda s: (s["setting"], s["workload"], s["mode"])):
        if s.get("predicted_speedup") is None:
            continue
        histogram = ", ".join(f"{k}: {n}" for k, n in (s["k_histogram"] or {}).items())
        rows.append([s["setting"], s["workload"], s["mode"], histogram, _f(s["plain_step_share"], "{:.0%}"),
                     _f(s["predicted_speedup"]), _f(s["measured_speedup"]), _f(s["speedup_median"])])
    return rows


def _header(rows: list[list[str]]) -> list[str]:
    return (HEADER + [ROOFLINE])[: len(rows[0])]


def _markdown_table(rows: list[list[str]], header: list[str] | None = None) -> str:
    header = header or _header(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _html_table(rows: list[list[str]], header: list[str] | None = None) -> str:
    cell = lambda v, tag: f"<{tag}>{html.escape(v).replace('**', '')}</{tag}>"
    head = "<tr>" + "".join(cell(h, "th") for h in header or _header(rows)) + "</tr>"
    body = "".join("<tr>" + "".join(cell(v, "td") for v in r) + "</tr>" for r in rows)
    return f"<table>{head}{body}</table>"


def plots(records: list[dict[str, Any]], folder: Path) -> list[str]:
    """speedup vs K per method; acceptance by candidate position; time split. PNG file names."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise VerispecError("plots need matplotlib: pip install matplotlib") from None
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    modes = sorted({r["mode"] for r in records}, key=lambda m: m != "greedy")
    methods = sorted({(r["method"], r["engine"], r["acceptance"], r["pair"]) for r in records if r["k"]})

    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for method, engine, rule, pair in methods:
            rows = [r for r in records if r["mode"] == mode and (r["method"], r["engine"], r["acceptance"], r["pair"]) == (method, engine, rule, pair)]
            ks = sorted({r["k"] for r in rows if isinstance(r["k"], int)})
            ys = [statistics.median(r["speedup"] for r in rows if r["k"] == k) for k in ks]
            if ks:
                line, = ax.plot(ks, ys, marker="o", label=_legend(method, engine, rule, pair))
            for k in sorted({r["k"] for r in rows if isinstance(r["k"], str)}):  # k="auto": one level, no K
                level = statistics.median(r["speedup"] for r in rows if r["k"] == k)
                ax.axhline(level, color=line.get_color() if ks else None, linestyle=":", linewidth=1.5,
                           label=f"{_legend(method, engine, rule, pair)} K={k}")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="plain decoding")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("candidate length K")
        ax.set_ylabel("speedup over plain (median of prompts)")
        ax.set_title(f"speedup vs K ({mode})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "speedup_vs_k.png", dpi=90)
    plt.close(fig)
    names.append("speedup_vs_k.png")

    settings = sorted({r["setting"] for r in records if r["acceptance_rate_by_position"]})
    if settings:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for setting in settings:
            positions = [r["acceptance_rate_by_position"] for r in records
                         if r["setting"] == setting and r["acceptance_rate_by_position"]]
            width = max(map(len, positions))
            ys = [statistics.fmean(p[i] for p in positions if len(p) > i) for i in range(width)]
            ax.plot(range(1, width + 1), ys, marker="o", label=setting)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("candidate position")
        ax.set_ylabel("P(accepted | drafted)")
        ax.set_ylim(0, 1.02)
        ax.set_title("acceptance by candidate position (all prompts and modes)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(folder / "acceptance_by_position.png", dpi=90)
        plt.close(fig)
        names.append("acceptance_by_position.png")

    labels = sorted({r["setting"] for r in records}, key=lambda s: (s != "plain", s))
    parts = {"prefill": [], "draft": [], "target / verify": [], "other": []}
    for setting in labels:
        rows = [r for r in records if r["setting"] == setting]
        mean = lambda key: statistics.fmean((r[key] or 0.0) for r in rows)  # unobserved (None) counts as 0
        # Every engine fills the same fields: the prefill call, drafting, target calls after it, the rest.
        for part, key in (("prefill", "prefill_seconds"), ("draft", "draft_seconds"),
                          ("target / verify", "verify_seconds"), ("other", "other_seconds")):
            parts[part].append(mean(key))
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(labels) + 1.5))
    left = [0.0] * len(labels)
    for name, values in parts.items():
        ax.barh(labels, values, left=left, label=name)
        left = [a + b for a, b in zip(left, values)]
    ax.set_xlabel("seconds per run (mean)")
    ax.set_title("time split")
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.subplots_adjust(left=0.28)
    fig.savefig(folder / "time_split.png", dpi=90)
    plt.close(fig)
    names.append("time_split.png")
    return names


def _legend(method: str, engine: str, rule: str, pair: str) -> str:
    text = f"{method} ({pair})" if engine == "verispec" else f"{method} (transformers)"
    return text if rule == "exact" else f"{text} [{rule}, approximate]"


def render_report(results: str | Path, out_dir: str | Path | None = None, plot: bool = True) -> Path:
    """Write report.md, report.html and PNG plots for a results file; returns the markdown path."""
    results = Path(results)
    meta, records = read_results(results)
    summaries = summarise(records)
    out = Path(out_dir) if out_dir else results.with_suffix("").parent / (results.stem + "_report")
    out.mkdir(parents=True, exist_ok=True)
    images = plots(records, out) if plot else []
    config, hw, ver = meta["config"], meta["hardware"], meta["versions"]
    approximate = sorted({r["setting"] for r in records if not r["exact"]})
    intro = [
        f"# Benchmark report: {config['target']}",
        "",
        f"Results: `{results.name}` ({len(records)} runs of {meta['runs']} planned; started {meta['started']}).",
        f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['threads']} threads, accelerator: {hw['accelerator'] or 'none'}. "
        f"verispec {ver['verispec']}, torch {ver['torch']}, transformers {ver['transformers']}; dtype {config['dtype']}.",
        f"Workloads: {', '.join(config['workloads'])}, {config['prompts']} prompt(s) each; {config['max_new_tokens']} new "
        f"tokens{' (EOS ignored: equal lengths)' if config['ignore_eos'] else ''}; {config['repetitions']} repetition(s); "
        f"seed {config['seed']}.",
        "",
        "Plain decoding ran on every prompt in the same run, right before the methods (interleaved, after a warm-up); "
        "each speedup is the ratio of end-to-end tokens/s to that prompt's plain run, shown as the median with "
        "[25th–75th percentile] (min–max under 4 prompts); \"after the first token\": the median ratio of the decode rates, "
        "leaving out the prefill, which is the same target pass in both runs (what speculation adds comes after it). Quality under the same settings: greedy runs count outputs "
        "identical to plain greedy; sampled runs compare the target's mean log-probability of the generated tokens "
        "with plain sampling's (Δ log p ± 2 standard errors over prompts; exact methods should include 0), and task "
        "metrics where the workload has references. transformers' runs are compared with verispec's plain run: "
        "in bf16 the two runtimes round differently (transformers keeps bf16 activations, verispec fp32), so "
        "their greedy outputs can part early without a fault in either. HumanEval completions are executed against "
        "the problem's tests (pass@1, 95% Wilson interval; cut at the Codex stop sequences); math answers "
        "(Spec-Bench math_reasoning and MT-Bench math) are scored by their final number "
        "(`verispec.bench.answers` states the rule).",
    ]
    if approximate:
        intro += ["", f"**Approximate (not distribution-preserving) settings:** {', '.join(approximate)}."]
    md, body = intro[:], []
    everything = tables(summarise([dict(r, workload="all workloads") for r in records]))
    for workload, rows in {**everything, **tables(summaries)}.items():
        md += ["", f"## {workload}", "", _markdown_table(rows)]
        body.append(f"<h2>{html.escape(workload)}</h2>{_html_table(rows)}")
    auto = auto_k_rows(summaries)
    if auto:
        md += ["", '## k="auto": what the controller chose, and what it predicted', "",
               "Predicted: the cost model's speedup over plain decoding, summed over the run's steps; measured: "
               "the same yardstick (the measured plain step) applied to the run's real step times; achieved: the "
               "ratio to the plain run on the same prompt (median over prompts).", "", _markdown_table(auto, AUTO_HEADER)]
        body.append("<h2>k=auto</h2>" + _html_table(auto, AUTO_HEADER))
    if images:
        md += ["", "## Plots", ""] + [f"![{name}]({name})" for name in images]
        body.append("<h2>Plots</h2>" + "".join(f'<p><img src="{name}" alt="{name}"></p>' for name in images))
    md_path = out / "report.md"
    md_path.write_text("\n".join(md) + "\n")
    intro_html = "".join(f"<p>{html.escape(line.lstrip('# ')).replace('**', '')}</p>" for line in intro[1:] if line)
    (out / "report.html").write_text(
        "<!doctype html><meta charset='utf-8'><title>verispec report</title><style>body{font-family:sans-serif;"
        "max-width:1200px;margin:auto}table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
        f"padding:3px 6px}}</style><h1>{html.escape(intro[0][2:])}</h1>{intro_html}{''.join(body)}")
    return md_path
