"""`verispec bench` and `verispec report`: end to end on tiny models, record schema, clear errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from verispec.bench import config_from_flags, load_config, load_workload, read_results, summarise
from verispec.bench.metrics import chrf, first_divergence, rouge_l
from verispec.cli import main
from verispec.errors import VerispecError
from tests.conftest import requires_shared

NUMBER = (int, float)
OPTIONAL_NUMBER = (int, float, type(None))
# The record contract, field by field: name -> allowed types. Run metrics carry GenerationStats' names.
RECORD_SCHEMA = {
    "type": str, "schema": int, "setting": str, "params": dict, "target": str, "pair": str, "acceptance": str,
    "hardware": dict, "versions": dict, "dtype": str, "quantization": (str, type(None)), "compared_with": str,
    "timing": str, "prefill_chunk": int,
    "workload": str, "prompt_id": str, "chat_template": bool,
    "repetition": int, "mode": str, "temperature": NUMBER, "top_k": int, "top_p": NUMBER,
    # GenerationStats fields
    "method": str, "settings": dict, "k": (int, str), "exact": bool, "engine": str, "sampling": dict, "seed": int,
    "prompt_tokens": int, "new_tokens": int, "target_calls": int, "draft_calls": (int, type(None)),
    "drafted_tokens": (int, type(None)), "accepted_tokens": (int, type(None)), "decode_steps": int,
    "decode_step_tokens": int, "drafted_by_position": (list, type(None)), "accepted_by_position": (list, type(None)),
    "wall_seconds": NUMBER, "prefill_seconds": NUMBER, "first_token_seconds": NUMBER,
    "draft_seconds": OPTIONAL_NUMBER, "verify_seconds": OPTIONAL_NUMBER, "k_histogram": (dict, type(None)),
    "calibration_seconds": OPTIONAL_NUMBER, "plain_steps": (int, type(None)), "probes": (int, type(None)), "warmup_steps": (int, type(None)),
    "prior_acceptance": OPTIONAL_NUMBER, "candidates_cut": (int, type(None)), "cut_to_plain": (int, type(None)),
    "cost_curve": (dict, type(None)), "acceptance_estimates": (list, type(None)),
    "predicted_speedup": OPTIONAL_NUMBER, "measured_speedup": OPTIONAL_NUMBER,
    # GenerationStats derived metrics
    "other_seconds": OPTIONAL_NUMBER, "tokens_per_second": NUMBER, "decode_tokens_per_second": NUMBER,
    "per_token_seconds": NUMBER, "target_calls_per_token": NUMBER, "acceptance_rate": OPTIONAL_NUMBER,
    "acceptance_rate_by_position": (list, type(None)), "mean_accepted_length": NUMBER,
    # comparison with plain decoding and quality
    "speedup": NUMBER, "plain_tokens_per_second": NUMBER, "decode_speedup": NUMBER, "plain_decode_tokens_per_second": NUMBER, "identical_to_plain": (bool, type(None)), "first_divergence": (int, type(None)), "same_tokens_as_plain": bool,
    "target_logprob_mean": NUMBER, "plain_target_logprob_mean": NUMBER, "metric": (str, type(None)),
    "metric_value": OPTIONAL_NUMBER, "plain_metric_value": OPTIONAL_NUMBER,
    "weight_bytes_per_token": (int, type(None)), "roofline": OPTIONAL_NUMBER,
    "output_text": str, "output_ids": list,
    # task checks: HumanEval executed, math answers scored (None where the prompt has neither)
    "passed": (bool, type(None)), "plain_passed": (bool, type(None)), "exec_result": (str, type(None)),
    "expected_answer": (str, type(None)), "model_answer": (str, type(None)), "answer_correct": (bool, type(None)),
    "plain_answer_correct": (bool, type(None)),
}
HARDWARE_FIELDS = {"cpu", "cores", "threads", "isa", "accelerator", "device"}
VERSION_FIELDS = {"verispec", "torch", "transformers", "python"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A small Spec-Bench / HumanEval lookalike with references for the task metrics."""
    root = tmp_path_factory.mktemp("data")
    (root / "spec_bench").mkdir()
    (root / "humaneval").mkdir()
    rows = [{"question_id": 1, "category": "writing", "turns": ["Write about cats."]},
            {"question_id": 2, "category": "translation", "turns": ["Translate German to English: guten Tag"],
             "reference": ["good day"]},
            {"question_id": 3, "category": "summarization", "turns": ["Summarize: the cat sat on the mat."],
             "reference": ["cat sat"]},
            {"question_id": 4, "category": "math_reasoning", "turns": ["What is 3 + 4?"], "reference": ["3+4=7\n#### 7"]}]
    (root / "spec_bench" / "question.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with gzip.open(root / "humaneval" / "HumanEval.jsonl.gz", "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "entry_point": "add",
                            "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"}) + "\n")
    return root


def _config(tmp_path: Path, target: Path, draft: Path, data: Path) -> Path:
    text = f"""
target = "{target}"
dtype = "float32"
workloads = ["humaneval", "spec_bench/translation", "spec_bench/summarization", "spec_bench/mt_bench",
             "spec_bench/math_reasoning"]
prompts = 1
max_new_tokens = 10
data_dir = "{data}"
[[sampling]]
temperature = 0.0
[[sampling]]
temperature = 0.8
top_p = 0.95
[[methods]]
name = "draft-model"
draft = "{draft}"
k = [2, 3]
acceptance = ["exact", "lenient:0.5"]
[[methods]]
name = "layer-skip"
skip = [1]
k = 2
[[methods]]
name = "early-exit"
layer = 1
k = "auto"
[[methods]]
name = "prompt-lookup"
ngram = 2
[[methods]]
name = "hf-assisted"
draft = "{draft}"
k = 3
[[methods]]
name = "hf-prompt-lookup"
k = 3
"""
    path = tmp_path / "bench.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, tiny_chat_pair, data_dir):
    tmp = tmp_path_factory.mktemp("bench")
    target, draft = tiny_chat_pair
    config = _config(tmp, target, draft, data_dir)
    out = tmp / "results.jsonl"
    result = CliRunner().invoke(main, ["bench", str(config), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_bench_end_to_end_writes_records_and_report(bench_run):
    out, output = bench_run
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    meta, records = read_results(out)
    assert lines[0]["type"] == "meta" and meta["config"]["max_new_tokens"] == 10
    assert [line["type"] for line in lines[1:]] == ["record"] * len(records)  # summaries are computed, not stored
    settings = 1 + 4 + 1 + 1 + 1 + 2  # plain, draft-model x 2 K x 2 rules, layer skip, early exit, prompt lookup, 2 hf
    assert len(records) == meta["runs"] == 5 * 2 * settings  # 5 prompts x 2 modes
    assert len(summarise(records)) == 5 * 2 * settings
    # plain runs precede the methods of the same prompt: interleaved, never all plain first
    first_prompt = [r["setting"] for r in records[:settings]]
    assert first_prompt[0] == "plain" and len(set(first_prompt)) == settings
    # the methods' order turns by one per prompt: no method always runs right after plain
    second_prompt = [r["setting"] for r in records[settings:2 * settings]]
    assert second_prompt[0] == "plain" and second_prompt[1:] == first_prompt[2:] + first_prompt[1:2]
    assert len({tuple(r["setting"] for r in records[i:i + 2]) for i in range(0, len(records), settings)}) > 1
    for r in records:
        if r["setting"] == "plain":
            assert r["speedup"] == 1.0 and r["k"] == 0
        if r["mode"] == "greedy" and r["exact"] and r["engine"] == "verispec":
            assert r["identical_to_plain"] is True, r["setting"]  # fp32: exact greedy equals plain greedy
        if not r["exact"]:
            assert r["acceptance"] == "lenient:0.5" and "lenient" in r["setting"]
        if r["workload"] == "spec_bench/translation":
            assert r["metric"] == "chrf" and 0 <= r["metric_value"] <= 100
        if r["engine"] == "transformers":
            assert r["target_calls"] >= 1 and r["target_calls"] <= r["new_tokens"]
        assert r["chat_template"] == (r["workload"] != "humaneval")
        if r["workload"] == "humaneval":  # executed against its test (a tiny random model fails it)
            assert r["passed"] is False and r["exec_result"].startswith("failed") and r["plain_passed"] is False
        else:
            assert r["passed"] is None and r["exec_result"] is None
        if r["workload"] == "spec_bench/math_reasoning":
            assert r["expected_answer"] == "7" and isinstance(r["answer_correct"], bool)
        else:
            assert r["expected_answer"] is None and r["answer_correct"] is None
        assert r["new_tokens"] == 10 == len(r["output_ids"])
    report = out.parent / "results_report"
    md = (report / "report.md").read_text()
    for name in ("speedup_vs_k.png", "acceptance_by_position.png", "time_split.png"):
        assert (report / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in md
    assert "## spec_bench/translation" in md and "APPROXIMATE" in md and "(transformers)" in md
    assert "pass@1 0.00 [0.00–0.79] of 1" in md and "answers correct" in md
    assert "<table>" in (report / "report.html").read_text()
    assert "100%|" in output and ("run/s" in output or "s/run" in output)  # tqdm's progress display


def test_every_record_field_has_its_type(bench_run):
    _, records = read_results(bench_run[0])
    for r in records:
        assert set(r) == set(RECORD_SCHEMA), set(r) ^ set(RECORD_SCHEMA)
        for name, kinds in RECORD_SCHEMA.items():
            assert isinstance(r[name], kinds), (name, r[name])
        assert set(r["hardware"]) == HARDWARE_FIELDS and set(r["versions"]) == VERSION_FIELDS
        assert r["hardware"]["threads"] >= 1 and r["versions"]["torch"]
        auto = r["k"] == "auto"  # K chosen per step: up to 8, possibly 0 (no speculation) throughout
        drafting = auto or r["k"] > 0
        if auto:
            assert r["predicted_speedup"] > 0 and r["cost_curve"]["verify_seconds"] and r["plain_steps"] is not None
            assert sum(r["k_histogram"].values()) == r["decode_steps"]
        elif r["engine"] == "verispec":
            assert r["predicted_speedup"] is None and r["cost_curve"] is None
        if drafting and r["engine"] == "verispec":
            if r["method"] != "prompt-lookup" and not auto:  # lookup proposes only what it finds, possibly nothing
                assert r["drafted_tokens"] > 0 and len(r["acceptance_rate_by_position"]) == r["k"]
            assert len(r["acceptance_rate_by_position"] or []) <= (8 if auto else r["k"])
            if r["drafted_tokens"]:
                assert r["acceptance_rate"] == pytest.approx(r["accepted_tokens"] / r["drafted_tokens"])
            assert r["draft_seconds"] >= 0 and r["verify_seconds"] > 0
        if r["mode"] == "greedy":
            assert r["identical_to_plain"] is not None and r["temperature"] == 0
        else:
            assert r["identical_to_plain"] is None and r["first_divergence"] is None and r["top_p"] == 0.95
        assert r["wall_seconds"] >= r["first_token_seconds"] > 0
        assert r["tokens_per_second"] == pytest.approx(r["new_tokens"] / r["wall_seconds"])


def test_interleaved_timing_end_to_end(tiny_chat_pair, data_dir, tmp_path):
    """timing = "interleaved": each method stepped together with a plain run of its own; records say so,
    the speculative runs still commit plain greedy's tokens, and each is compared with its own plain run."""
    target, draft = tiny_chat_pair
    config = tmp_path / "interleaved.toml"
    config.write_text(f"""
target = "{target}"
dtype = "float32"
workloads = ["humaneval", "spec_bench/translation"]
prompts = 1
max_new_tokens = 10
data_dir = "{data_dir}"
timing = "interleaved"
execute = false
[[methods]]
name = "draft-model"
draft = "{draft}"
k = [2, "auto"]
[[methods]]
name = "prompt-lookup"
ngram = 2
""")
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(main, ["bench", str(config), "-o", str(out), "--no-report"])
    assert result.exit_code == 0, result.output
    records = [r for r in read_results(out)[1]]
    assert len(records) == 2 * 4 and {r["timing"] for r in records} == {"interleaved"}
    assert {r["prefill_chunk"] for r in records} == {128}
    assert all(r["identical_to_plain"] for r in records if r["setting"] != "plain")
    assert all(0 < r["first_token_seconds"] <= r["wall_seconds"] for r in records)
    # every method compares with a plain run made beside it, not with the prompt's recorded plain run
    for r in records:
        if r["setting"] != "plain":
            plain = next(q for q in records if q["setting"] == "plain" and q["prompt_id"] == r["prompt_id"])
            assert r["plain_tokens_per_second"] != plain["tokens_per_second"]
            assert r["speedup"] == pytest.approx(r["tokens_per_second"] / r["plain_tokens_per_second"])
            assert r["plain_decode_tokens_per_second"] != plain["decode_tokens_per_second"]
            assert r["decode_speedup"] == pytest.approx(r["decode_tokens_per_second"] / r["plain_decode_tokens_per_second"])
    flags = load_config(config, timing="sequential")
    assert flags.timing == "sequential"  # the --timing flag overrides the file


def test_the_warm_up_measures_k_auto_costs_for_every_decoding_mode(tiny_chat_pair, data_dir, tmp_path, monkeypatch):
    """k="auto" measures a cost curve per way of judging a row (greedy, sampled): the warm-up runs every
    setting in every decoding mode, so no recorded run pays a calibration. Control: without the warm-up
    the first recorded auto run of each mode does."""
    from verispec import adaptive

    target, _ = tiny_chat_pair
    calibrated = {}
    for warmup in (8, 0):
        monkeypatch.setattr(adaptive, "_MEASURED", {})
        monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / f"cache{warmup}"))
        config = tmp_path / f"modes{warmup}.toml"
        config.write_text(f"""
target = "{target}"
dtype = "float32"
workloads = ["spec_bench/translation"]
prompts = 2
max_new_tokens = 8
data_dir = "{data_dir}"
execute = false
warmup_tokens = {warmup}
[[sampling]]
temperature = 0.0
[[sampling]]
temperature = 1.0
[[methods]]
name = "prompt-lookup"
ngram = 2
k = ["auto"]
""")
        out = tmp_path / f"modes{warmup}.jsonl"
        result = CliRunner().invoke(main, ["bench", str(config), "-o", str(out), "--no-report"])
        assert result.exit_code == 0, result.output
        calibrated[warmup] = {r["mode"]: r["calibration_seconds"] for r in read_results(out)[1] if r["k"] == "auto"
                              and r["calibration_seconds"]}
    assert calibrated[8] == {}
    assert set(calibrated[0]) == {"greedy", "T=1 top_k=0 top_p=1"}, calibrated[0]


def test_report_command_rerenders(bench_run, tmp_path):
    result = CliRunner().invoke(main, ["report", str(bench_run[0]), "-o", str(tmp_path / "r"), "--no-plots"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r" / "report.md").exists() and not (tmp_path / "r" / "time_split.png").exists()


def test_existing_results_are_not_overwritten(bench_run, tiny_chat_pair, data_dir):
    result = CliRunner().invoke(main, ["bench", "-m", str(tiny_chat_pair[0]), "--prompt-lookup", "2",
                                       "--data-dir", str(data_dir), "-o", str(bench_run[0])])
    assert result.exit_code == 2 and "--overwrite" in result.output


def test_flags_build_the_same_config_as_a_file(tiny_chat_pair, data_dir, tmp_path):
    target, draft = tiny_chat_pair
    toml = tmp_path / "same.toml"
    toml.write_text(f"""
target = "{target}"
dtype = "float32"
workloads = ["spec_bench/translation"]
data_dir = "{data_dir}"
prompts = 1
max_new_tokens = 6
[[sampling]]
temperature = 0.0
[[sampling]]
temperature = 0.7
[[methods]]
name = "draft-model"
draft = "{draft}"
k = [2]
acceptance = ["exact", "topk:2"]
""")
    from_flags = config_from_flags(
        None, {"--draft": str(draft)}, "2", ("exact", "topk:2"), {}, (0.0, 0.7), 0, 1.0, target=str(target),
        dtype="float32", workloads=["spec_bench/translation"], data_dir=str(data_dir), prompts=1, max_new_tokens=6)
    assert from_flags == load_config(toml)
    # and the command line's flags reach config_from_flags unchanged: the run has exactly these settings
    out = tmp_path / "flags.jsonl"
    result = CliRunner().invoke(main, ["bench", "-m", str(target), "--dtype", "float32", "--draft", str(draft),
                                       "-k", "2", "--acceptance", "exact", "--acceptance", "topk:2",
                                       "--workload", "spec_bench/translation", "--data-dir", str(data_dir),
                                       "--prompts", "1", "-n", "6", "-t", "0", "-t", "0.7", "-o", str(out), "--no-report"])
    assert result.exit_code == 0, result.output
    _, records = read_results(out)
    name = draft.name
    assert sorted({r["setting"] for r in records}) == [f"draft-model(draft={name}) K=2", f"draft-model(draft={name}) K=2 [topk:2]", "plain"]
    assert {r["mode"] for r in records} == {"greedy", "T=0.7 top_k=0 top_p=1"}


def test_missing_data_files_are_clear_errors(tmp_path, tiny_chat_pair):
    for workload in ("humaneval", "spec_bench", "spec_bench/qa"):
        with pytest.raises(VerispecError, match="--data-dir"):
            load_workload(workload, 1, tmp_path)
    result = CliRunner().invoke(main, ["bench", "-m", str(tiny_chat_pair[0]), "--prompt-lookup", "2",
                                       "--workload", "humaneval", "--data-dir", str(tmp_path), "-o", str(tmp_path / "x.jsonl")])
    assert result.exit_code == 2 and "HumanEval prompts are missing" in result.output
    assert "Traceback" not in result.output


def test_user_jsonl_workloads(tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text(json.dumps({"prompt": "hi", "id": "a", "reference": "hello", "metric": "chrf"}) + "\n"
                    + json.dumps({"prompt": "bye"}) + "\n")
    prompts = load_workload(str(good), 5)
    assert [p.id for p in prompts] == ["a", "1"] and prompts[0].metric == "chrf" and prompts[1].reference is None
    assert prompts[0].workload == "mine"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no prompt field"}) + "\n")
    with pytest.raises(VerispecError, match="'prompt'"):
        load_workload(str(bad), 5)
    with pytest.raises(VerispecError, match="does not exist"):
        load_workload(str(tmp_path / "absent.jsonl"), 5)
    with pytest.raises(VerispecError, match="unknown workload"):
        load_workload("mmlu", 5)
    with pytest.raises(VerispecError, match="unknown Spec-Bench category"):
        load_workload("spec_bench/poetry", 5, tmp_path)


def test_shared_spec_bench_and_humaneval_load():
    data = requires_shared() / "data"
    prompts = load_workload("spec_bench", 2, data)
    assert sorted({p.workload for p in prompts}) == sorted(f"spec_bench/{c}" for c in
                                                            ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"))
    assert len(prompts) == 12
    translation = [p for p in prompts if p.workload == "spec_bench/translation"]
    assert all(p.reference and p.metric == "chrf" for p in translation)
    humaneval = load_workload("humaneval", 3, data)
    assert len(humaneval) == 3 and humaneval[0].id == "HumanEval/0" and humaneval[0].completion


BAD_CONFIGS = {
    "no target": ({"methods": []}, "'target'"),
    "unknown key": ({"target": "m", "tempreature": 1}, "unknown key 'tempreature'"),
    "unknown method": ({"target": "m", "methods": [{"name": "medusa"}]}, "unknown method 'medusa'"),
    "missing draft": ({"target": "m", "methods": [{"name": "draft-model"}]}, "'draft' is required"),
    "bad k": ({"target": "m", "methods": [{"name": "prompt-lookup", "k": 0}]}, "'k'.* must be a positive integer or 'auto'"),
    "auto k for transformers": ({"target": "m", "methods": [{"name": "hf-prompt-lookup", "k": "auto"}]},
                                "transformers' engines take a fixed K"),
    "bad ngram": ({"target": "m", "methods": [{"name": "prompt-lookup", "ngram": 0}]}, "'ngram' must be an integer >= 1"),
    "bad rule": ({"target": "m", "methods": [{"name": "prompt-lookup", "acceptance": "lenient:2"}]}, "lenience"),
    "hf approx": ({"target": "m", "methods": [{"name": "hf-assisted", "draft": "d", "acceptance": "topk:2"}]},
                  "only its exact rule"),
    "method key": ({"target": "m", "methods": [{"name": "early-exit", "layer": 2, "rank": 3}]}, "no parameter 'rank'"),
    "low rank both": ({"target": "m", "methods": [{"name": "low-rank", "rank": 8, "energy": 0.9}]}, "exactly one"),
    "bad sampling": ({"target": "m", "sampling": [{"temperature": -1}]}, "sampling\\[0\\]"),
    "bad dtype": ({"target": "m", "dtype": "int3"}, "dtype"),
    "bad tokens": ({"target": "m", "max_new_tokens": 0}, "max_new_tokens"),
    "duplicate": ({"target": "m", "methods": [{"name": "prompt-lookup"}, {"name": "prompt-lookup"}]}, "twice"),
    "bad timing": ({"target": "m", "timing": "parallel"}, "'timing' must be sequential or interleaved"),
    "interleaved transformers": ({"target": "m", "timing": "interleaved", "methods": [{"name": "hf-plain"}]},
                                 "transformers' generate runs whole"),
    "bad prefill chunk": ({"target": "m", "prefill_chunk": -1}, "'prefill_chunk' must be an integer >= 0"),
    "prefill chunk not a number": ({"target": "m", "prefill_chunk": "big"}, "'prefill_chunk' must be an integer"),
    "chunked transformers": ({"target": "m", "prefill_chunk": 64, "methods": [{"name": "hf-plain"}]},
                             "transformers' generate prefills in one pass"),
}


def test_interleaved_timing_prefills_in_chunks_unless_told_otherwise():
    assert load_config(base={"target": "m", "timing": "interleaved"}).prefill_chunk == 128
    assert load_config(base={"target": "m"}).prefill_chunk == 0  # sequential: one pass, as users run
    assert load_config(base={"target": "m", "timing": "interleaved"}, prefill_chunk=0).prefill_chunk == 0
    assert load_config(base={"target": "m", "timing": "interleaved", "prefill_chunk": 32}).prefill_chunk == 32


def test_a_method_without_k_runs_auto_and_transformers_engines_their_fixed_k():
    methods = [{"name": "prompt-lookup"}, {"name": "layer-skip", "skip": [1]}, {"name": "draft-model", "draft": "d"},
               {"name": "hf-prompt-lookup"}, {"name": "hf-assisted", "draft": "d"}, {"name": "prompt-lookup", "k": 3}]
    ks = {s.label: s.k for s in load_config(base={"target": "m", "methods": methods}).settings}
    assert list(ks.values()) == ["auto", "auto", "auto", 5, 5, 3], ks


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_configs_are_clear_errors(case):
    raw, message = BAD_CONFIGS[case]
    with pytest.raises(VerispecError, match=message):
        load_config(base=raw)


def test_bad_config_files_fail_cleanly_on_the_cli(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text("target = \n")
    for args in (["bench", str(broken)], ["bench", str(tmp_path / "absent.toml")], ["bench"],
                 ["report", str(tmp_path / "absent.jsonl")], ["report", str(broken)]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, (args, result.output)
        assert result.output.startswith("error:") and "Traceback" not in result.output


def test_metrics():
    assert chrf("good day", "good day") == pytest.approx(100)
    assert chrf("xyz", "abc") == 0
    assert 0 < chrf("good morning", "good day") < 100
    assert rouge_l("the cat sat", "the cat was sat") == pytest.approx(100 * 2 * 1 * 0.75 / 1.75)
    assert rouge_l("", "x") == 0
    assert rouge_l("The cat.", "the cat") == pytest.approx(100)  # punctuation is not part of a word (rouge-score)
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
