"""The structure the features plug into: one drafter registry, declared protocols, a record module
and a report renderer that load no runtime."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import verispec
from verispec.bench import load_config
from verispec.cli import main
from verispec.drafters import DRAFTERS, DrafterSpec, Param, make_choice, parse_drafter, register
from verispec.drafters.registry import choices_from_flags
from verispec.errors import VerispecError
from verispec.models.protocol import DecoderModel, LayeredModel
from verispec.sampling import SamplingConfig
from verispec.testing import tiny_model

SRC = Path(verispec.__file__).parent


# ------------------------------------------------------------------ a new drafter: one class, one registration

class RepeatLast(verispec.DrafterBase):
    """A toy drafter: proposes the last committed token ``times`` over (deterministic, no q)."""

    method = "repeat-last"

    def __init__(self, times: int = 1, k: int | None = None) -> None:
        super().__init__(3 if k is None else k)
        self.times = times

    def settings(self):
        return {"method": self.method, "k": self.k, "times": self.times}

    def propose(self, context, k):
        return verispec.Proposal(torch.tensor([context.tokens[-1]] * min(k, self.times)), None)


TOY = DrafterSpec(
    name="repeat-last", summary="repeats the last token",
    params=(Param("times", "int", "How many times to repeat it."),),
    build=lambda p, k, load: RepeatLast(**p, k=k), describe=lambda p, target: f"{target} repeating its last token",
    default_k=3,
)


@pytest.fixture()
def toy_registered():
    register(TOY)  # the one registration line a new drafter needs
    yield
    DRAFTERS.pop(TOY.name)


def test_a_registered_drafter_works_everywhere(toy_registered, tiny_chat_pair, tmp_path):
    # Python, by name and by spec string
    choice = parse_drafter("repeat-last:times=2,k=4")
    assert (choice.name, dict(choice.params), choice.k) == ("repeat-last", {"times": 2}, 4)
    with pytest.raises(VerispecError, match="'times' must be an integer >= 1"):
        make_choice("repeat-last", {"times": 0})
    model = tiny_model(vocab=16, seed=0)
    plain = verispec.generate(model, input_ids=[1, 2, 3], max_new_tokens=12)
    spec = verispec.generate(model, input_ids=[1, 2, 3], max_new_tokens=12, drafter=choice.build())
    assert spec.token_ids == plain.token_ids and spec.stats.method == "repeat-last" and spec.stats.drafted_tokens > 0
    # bench config
    config = load_config(base={"target": "m", "methods": [{"name": "repeat-last", "times": 2, "k": [2, 3]}]})
    assert [(s.method, s.k, s.params) for s in config.settings] == [("repeat-last", 2, {"times": 2}),
                                                                    ("repeat-last", 3, {"times": 2})]
    # CLI
    result = CliRunner().invoke(main, ["generate", "hello", "-m", str(tiny_chat_pair[0]), "--dtype", "float32",
                                       "-n", "6", "--drafter", "repeat-last:times=2", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output[result.output.index("{"):])
    assert record["stats"]["method"] == "repeat-last" and record["stats"]["k"] == 3


def test_no_drafter_is_constructed_outside_the_drafters_package():
    """Drafters are built through the registry: no module outside drafters/ calls a drafter class."""
    names = {"DraftModel", "LayerSkip", "EarlyExit", "LowRank", "PromptLookup"}
    offenders = []
    for path in SRC.rglob("*.py"):
        if "drafters" in path.relative_to(SRC).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name in names:
                    offenders.append(f"{path.relative_to(SRC)}:{node.lineno} {name}")
    assert not offenders, offenders


def test_flags_and_specs_build_the_same_drafter():
    from_flags = choices_from_flags({"--layer-skip": "3,5", "--draft": None}, "2")
    assert from_flags == [parse_drafter("layer-skip:skip=3+5,k=2")] == [make_choice("layer-skip", {"skip": [3, 5]}, 2)]
    assert make_choice("draft-model", {"draft": "x"}).k == "auto" == make_choice("prompt-lookup").k  # one default
    assert make_choice("layer-skip", {"skip": [1]}).k == "auto"
    assert parse_drafter(make_choice("prompt-lookup").as_text()) == make_choice("prompt-lookup")  # "k=auto" round-trips
    for choice in (from_flags[0], make_choice("low-rank", {"energy": 0.5, "targets": "mlp"}, 3)):
        assert parse_drafter(choice.as_text()) == choice  # the spec form round-trips
    for flags, message in (({"--prompt-lookup": "0"}, "'ngram' must be an integer >= 1"),
                           ({"--low-rank-rank": "0"}, "'rank' must be an integer >= 1"),
                           ({"--early-exit": "-1"}, "'layer' must be an integer >= 1"),
                           ({"--low-rank-targets": "mlp"}, "add --low-rank-rank or --low-rank-energy")):
        with pytest.raises(VerispecError, match=message):
            choices_from_flags(flags)
    with pytest.raises(VerispecError, match="'k'.*must be a positive integer or 'auto'"):
        choices_from_flags({"--prompt-lookup": "3"}, "0")


# ------------------------------------------------------------------ declared protocols

def test_models_declare_the_protocols(tiny_llama):
    from verispec.models.loading import load_model

    native, hf = load_model(tiny_llama), load_model(tiny_llama, backend="hf")
    assert isinstance(native, LayeredModel) and isinstance(hf, DecoderModel) and not isinstance(hf, LayeredModel)
    assert native.folder == hf.folder == tiny_llama and native.name == str(tiny_llama)
    with pytest.raises(VerispecError, match="needs the native backend"):
        verispec.generate(hf, input_ids=[1, 2], max_new_tokens=4, drafter=verispec.LayerSkip([0], k=2))
    with pytest.raises(VerispecError, match="drafter must implement"):
        verispec.generate(native, input_ids=[1, 2], max_new_tokens=4, drafter=object())
    with pytest.raises(VerispecError, match="model must come from"):
        verispec.generate(object(), input_ids=[1, 2], max_new_tokens=4)


def test_one_early_exit_serves_two_targets_of_different_depth_interleaved():
    shallow, deep = tiny_model(vocab=16, seed=3, layers=3), tiny_model(vocab=16, seed=4, layers=6)
    drafter = verispec.EarlyExit(layer=2, k=3)
    runs = [verispec.stream(m, input_ids=[1, 2, 3], max_new_tokens=20, drafter=drafter) for m in (shallow, deep)]
    steps = [iter(r) for r in runs]
    pending = [True, True]
    while any(pending):  # one step of each run in turn: each must keep its own layer split
        for i, it in enumerate(steps):
            if pending[i] and next(it, None) is None:
                pending[i] = False
    for model, run in zip((shallow, deep), runs):
        assert run.result().token_ids == verispec.generate(model, input_ids=[1, 2, 3], max_new_tokens=20).token_ids


# ------------------------------------------------------------------ results without the runtime

def test_records_and_report_load_no_torch_or_runtime():
    code = ("import sys, verispec.bench.records, verispec.bench.report, verispec.stats; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('verispec.models', 'verispec.decoding', "
            "'verispec.drafters', 'verispec.bench.runner', 'verispec.bench.engines', 'transformers'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_record_is_generation_stats(bench_results):
    """A bench record carries every GenerationStats field and metric under its own name and value."""
    from verispec.bench.records import read_results
    from verispec.stats import GenerationStats

    _, records = read_results(bench_results)
    names = {f for f in GenerationStats.__dataclass_fields__} | set(GenerationStats.DERIVED)
    for r in records:
        assert names <= set(r)
        fields = {f: r[f] for f in GenerationStats.__dataclass_fields__}
        rebuilt = GenerationStats(**fields)
        for metric in GenerationStats.DERIVED:
            assert getattr(rebuilt, metric) == r[metric], metric


@pytest.fixture(scope="module")
def bench_results(tmp_path_factory, tiny_chat_pair):
    folder = tmp_path_factory.mktemp("structure")
    data = folder / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "the cat sat"}) + "\n")
    out = folder / "r.jsonl"
    result = CliRunner().invoke(main, ["bench", "-m", str(tiny_chat_pair[0]), "--dtype", "float32", "--prompt-lookup",
                                       "2", "--hf-plain", "--workload", str(data), "-n", "6", "-t", "0", "-t", "0.9",
                                       "-o", str(out), "--no-report"])
    assert result.exit_code == 0, result.output
    return out


def test_sampling_config_rejects_bools_as_numbers():
    """SamplingConfig validation goes through one validator: bools are not numbers."""
    for bad in (dict(temperature=True), dict(top_p=True), dict(top_k=True), dict(seed=True), dict(top_k=1.0)):
        with pytest.raises(VerispecError):
            SamplingConfig(**bad)
