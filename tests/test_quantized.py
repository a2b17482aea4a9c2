"""int8 runtime: integer-exact kernels, batch invariance, quantized targets and drafts, the disk cache."""

from __future__ import annotations

import logging

import pytest
import torch

import verispec
from verispec import kernels
from verispec.errors import VerispecError
from verispec.models import quantize as quantize_module
from verispec.models.quantize import cache_path, check_scheme, quantize_model
from verispec.sampling import SamplingConfig
from tests.conftest import missing_setup
from tests.distribution import assert_exercised, chi_square_pvalue, exact_distribution, sample_with_exercise
from tests.test_bench import data_dir  # noqa: F401  (the fixture)
from tests.test_speculative import ALPHA
from verispec.testing import perturbed, tiny_model

# (out, in): tails on every path; AMX prompts: 300 channels take pairs of blocks in chunks, and 1600 inputs
# (a row pair of A tiles past a 48 KB L1) the other loop order
SHAPES = [(64, 1536), (7, 100), (5, 3), (33, 130), (130, 64), (300, 200), (40, 1600)]


def _paths() -> list[str]:
    return [p for p in kernels.int8_paths() if p != "torch"] + ["torch"]


@pytest.mark.parametrize("out,inner", SHAPES)
def test_every_int8_path_gives_the_same_integers(out, inner):
    torch.manual_seed(out * inner)
    w = torch.randint(-127, 128, (out, inner), dtype=torch.int8)
    sums = w.sum(dim=1, dtype=torch.int32)
    for rows in (1, 2, 3, 4, 5, 8, 15, 16, 17, 32, 33, 50, 65):  # AMX: 1 x 4 tiles to 16 rows, then 2 x 2
        q = torch.randint(-127, 128, (rows, inner), dtype=torch.int8)
        reference = q.long() @ w.long().t()
        for path in _paths():
            got = kernels.int8_accumulate(q, w, sums, path)
            assert got.dtype is torch.int32 and torch.equal(got.long(), reference), (path, rows)


def _row_at_a_time(linear, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([linear(x[i:i + 1]) for i in range(x.shape[0])])


def _per_tensor_int8(weight: torch.Tensor, scale: torch.Tensor):
    """The negative control: one activation scale for the whole batch (torch.ao's dynamic int8). Integer
    sums, yet a row's result depends on the other rows through the shared scale."""
    def linear(x: torch.Tensor) -> torch.Tensor:
        s = x.abs().max() / 127
        q = torch.round(x / s).clamp(-127, 127).to(torch.int8)
        return torch._int_mm(q, weight.t()).float() * s * scale
    return linear


@pytest.mark.parametrize("inner", [1536, 100])
def test_int8_rows_do_not_depend_on_the_batch(inner):
    torch.manual_seed(inner)
    layer = kernels.Int8Linear.from_float(torch.randn(96, inner), torch.randn(96))
    control = _per_tensor_int8(layer.rows(), layer.scale)
    caught = 0
    for rows in range(1, 17):
        x = torch.randn(rows, inner)
        x[-1] *= 50  # an outlier token: it must not change the other rows' results
        alone = _row_at_a_time(layer, x)
        assert torch.equal(layer(x), alone), rows
        assert torch.equal(layer(x.view(1, rows, inner))[0], alone), rows
        if rows > 1:
            caught += not torch.equal(control(x), _row_at_a_time(control, x))
    assert caught == 15  # the same check sees a batch-dependent scale at every M > 1


def test_many_rows_and_the_torch_fallback_give_the_same_bits(monkeypatch):
    torch.manual_seed(1)
    layer = kernels.Int8Linear.from_float(torch.randn(80, 192), torch.randn(80))
    x = torch.randn(40, 192)  # more than MAX_ROWS: torch's _int_mm path
    compiled = layer(x)
    assert torch.equal(compiled[:16], layer(x[:16])) and torch.equal(compiled[-1:], layer(x[-1:]))
    q_compiled = kernels.quantize_rows(x)
    monkeypatch.setitem(kernels._state, "module", None)
    assert torch.equal(layer(x), compiled)  # no compiler: slower, the same numbers
    q_torch = kernels.quantize_rows(x)
    assert torch.equal(q_torch[0], q_compiled[0]) and torch.equal(q_torch[1], q_compiled[1])


def test_quantized_rows_are_close_to_the_float_product_and_bad_rows_are_nan():
    torch.manual_seed(2)
    w, x = torch.randn(64, 256), torch.randn(6, 256)
    layer = kernels.Int8Linear.from_float(w)
    exact = x @ w.t()
    assert (layer(x) - exact).abs().max() < 0.05 * exact.abs().max()
    x[2, 7] = float("nan")
    x[4] = 0.0
    y = layer(x)
    assert torch.isnan(y[2]).all() and torch.equal(y[4], torch.zeros(64))
    assert torch.isfinite(y[[0, 1, 3, 5]]).all()


def _int8_tiny(**kw):
    return quantize_model(tiny_model(**kw), "int8")


def test_a_quantized_model_gives_each_row_the_same_logits_in_any_batch():
    model = _int8_tiny(vocab=40, seed=1, layers=3, hidden=64, context=128)
    longest = kernels.MAX_K + 1  # the longest verification pass: K = MAX_K candidates and the bonus row
    tokens = torch.randint(0, 40, (10 + longest,), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(10 + longest)
    model.forward(tokens[:10], cache, 0)
    one_by_one = torch.cat([model.forward(tokens[10 + i:11 + i], cache, 10 + i) for i in range(longest)])
    for T in (2, 5, 9, 16, 17, 33, 40, longest):
        batch_cache = model.new_cache(10 + longest)
        model.forward(tokens[:10], batch_cache, 0)
        assert torch.equal(model.forward(tokens[10:10 + T], batch_cache, 10), one_by_one[:T]), T


def test_a_prompts_mlp_in_chunks_gives_the_bits_of_one_pass(monkeypatch):
    from verispec.models import transformer

    model = _int8_tiny(vocab=40, seed=2, layers=2, hidden=64, context=300)
    tokens = torch.randint(0, 40, (300,), generator=torch.Generator().manual_seed(1))
    chunked = model.forward(tokens, model.new_cache(300), 0)
    monkeypatch.setattr(transformer, "MLP_ROWS", 1000)
    whole = model.forward(tokens, model.new_cache(300), 0)
    assert torch.equal(chunked, whole)
    monkeypatch.setattr(transformer, "MLP_ROWS", 7)  # chunks that end mid-prompt, and a short last one
    assert torch.equal(model.forward(tokens, model.new_cache(300), 0), whole)


@pytest.mark.parametrize("half", [48, 40, 160])  # gate and up in whole 16-channel blocks, or not; chunks of pairs
def test_silu_applied_as_the_sums_leave_the_tiles_gives_the_bits_of_product_then_silu(half):
    torch.manual_seed(half)
    layer = kernels.Int8Linear.from_float(torch.randn(2 * half, 96))
    module = kernels._load()
    for rows in (1, 5, 16, 17, 33, 50, 128):
        x = torch.randn(1, rows, 96)
        x[0, -1] *= 40  # an outlier row
        fused = kernels.gate_up_silu(layer, x)
        assert fused.shape == (1, rows, half) and torch.equal(fused, kernels.silu_mul(layer(x))), rows
        if module is not None and "amx" in kernels.int8_paths() and kernels.weight_layout(kernels.few_row_path()) == "packed":
            on_tiles = module.int8_silu_on_tiles(x, layer.weight, 2 * half, kernels.int8_path(rows))
            assert on_tiles == (rows > 16 and half % 16 == 0 and kernels.int8_path(rows) == "amx"), rows


def test_k_above_the_row_by_row_limit_is_refused():
    assert verispec.PromptLookup(k=kernels.MAX_K).k == kernels.MAX_K
    with pytest.raises(VerispecError, match="at most 64"):
        verispec.PromptLookup(k=kernels.MAX_K + 1)


GREEDY_DRAFTERS = {
    "draft-model": lambda k, draft: verispec.DraftModel(draft, k=k),
    "layer-skip": lambda k, draft: verispec.LayerSkip(skip=[1], k=k),
    "early-exit": lambda k, draft: verispec.EarlyExit(layer=1, k=k),
    "low-rank": lambda k, draft: verispec.LowRank(rank=8, k=k),
    "prompt-lookup": lambda k, draft: verispec.PromptLookup(ngram=1, k=k),
}


@pytest.mark.parametrize("name", list(GREEDY_DRAFTERS))
def test_int8_greedy_speculative_equals_int8_plain_greedy(name):
    float_target = tiny_model(vocab=24, seed=4, layers=3, hidden=64, sharpness=1.5)
    draft = quantize_model(perturbed(float_target, seed=5, scale=0.2), "int8")
    target = quantize_model(float_target, "int8")
    accepted = 0
    for k in (1, 4, 8, 32):
        for prompt in ([1, 5, 9], [3, 3, 3, 3, 7, 3, 3]):
            plain = verispec.generate(target, input_ids=prompt, max_new_tokens=40)
            spec = verispec.generate(target, input_ids=prompt, max_new_tokens=40, drafter=GREEDY_DRAFTERS[name](k, draft))
            assert spec.token_ids == plain.token_ids, (name, k, prompt)
            assert spec.stats.settings["quantization"] == "int8"
            accepted += spec.stats.accepted_tokens
    assert accepted > 0


def test_quantized_draft_is_greedy_exact_for_a_float_target():
    target = tiny_model(vocab=24, seed=4, layers=3, hidden=64, sharpness=1.5)
    for bits in (8, 4):
        for k in (1, 4, 16):
            plain = verispec.generate(target, input_ids=[2, 7, 1], max_new_tokens=30)
            spec = verispec.generate(target, input_ids=[2, 7, 1], max_new_tokens=30, drafter=verispec.QuantizedDraft(bits, k=k))
            assert spec.token_ids == plain.token_ids
            assert spec.stats.method == "quantized" and spec.stats.settings["bits"] == bits
            assert spec.stats.settings["extra_megabytes"] > 0 and spec.stats.accepted_tokens > 0
            if k == 1:  # the quantized pass mostly agrees with the float one
                assert spec.stats.acceptance_rate > 0.5


def _tiny_target():  # hidden 32: the int4 kernel's smallest group, so int4 drafts really run in int4
    return tiny_model(vocab=3, seed=5, layers=3, hidden=32, sharpness=1.0)


SAMPLED = 2500
# K = 2 of the 6 judged tokens: a draft this close to its target accepts nearly everything, and a
# larger K would then leave no room for a second proposal in a run (the first token comes from the
# prompt pass; 1 + (K + 1) must stay below 5).
DISTRIBUTION_CASES = {
    "quantized-8": (lambda draft: verispec.QuantizedDraft(8, k=2), SamplingConfig(1.5, top_p=0.8)),
    "quantized-4": (lambda draft: verispec.QuantizedDraft(4, k=2), SamplingConfig(0.8, top_k=2)),
    "int8 draft model": (lambda draft: verispec.DraftModel(quantize_model(draft, "int8"), k=2), SamplingConfig(1.0)),
}


@pytest.mark.parametrize("case", list(DISTRIBUTION_CASES))
def test_quantized_drafts_preserve_a_float_targets_distribution(case):
    target = _tiny_target()
    make_drafter, sampling = DISTRIBUTION_CASES[case]
    draft = tiny_model(vocab=3, seed=6, layers=1, hidden=32, sharpness=1.0)
    drafter = make_drafter(draft)
    counts, exercise = sample_with_exercise(target, lambda: drafter, sampling, SAMPLED)
    assert_exercised(exercise, 2)
    law = exact_distribution(target, sampling)
    assert len(law) > 50  # a law with room to be wrong in (top-p 0.7 would leave one sequence here)
    pvalue = chi_square_pvalue(counts, law)
    assert pvalue > ALPHA, f"{case}: p = {pvalue:.2e}"


def test_int4_draft_really_runs_int4():
    target = _tiny_target()
    plan = verispec.QuantizedDraft(4, k=2).check(target)
    form = kernels.PackedInt4Linear if kernels.available() else kernels.Int4Linear
    assert all(isinstance(getattr(p, m), form) for p in plan.projections for m in ("qkv", "o", "gate_up", "down"))
    if kernels.available():  # and the decoder layers run in the one compiled call, int4 products included
        assert kernels.layer_stack([target.layers[0].attn_norm, target.layers[0].mlp_norm,
                                    *(getattr(plan.projections[0], m) for m in ("qkv", "o", "gate_up", "down"))],
                                   target.config) is not None


@pytest.fixture
def int4_path_restored():
    """Tests below switch the int4 path; the process's chosen one is put back afterwards."""
    if not kernels.available():
        missing_setup("the packed int4 kernel needs verispec's compiled kernels (no AVX2, no compiler, or "
                      "VERISPEC_KERNELS=0)")
    chosen = kernels.int4_path()
    yield kernels._load()
    kernels._load().set_int4_path(chosen)


def _int4_reference(layer: kernels.PackedInt4Linear, x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in fp64: the int8 rows times the dense int4 weights, plus the bias."""
    q, scale = kernels.quantize_rows(x)
    return (q.double() * scale.double()[:, None]) @ layer.dense().double().t() + layer.bias.double()


def _misplaced_nibbles(layer: kernels.PackedInt4Linear) -> kernels.PackedInt4Linear:
    """The negative control: the last 16 channels' last 8 inputs packed with their nibbles swapped (inputs
    i..i+3 read as i+4..i+7), wrong only at the end of the last block."""
    packed = layer.packed.clone()
    last = packed[-1, -1]
    packed[-1, -1] = (last >> 4) | (last << 4)
    return kernels.PackedInt4Linear(packed, layer.groups, layer.bias)


@pytest.mark.parametrize("out,inner", [(16, 32), (48, 64), (3072, 576), (64, 1536)])
def test_every_int4_path_computes_the_product_of_its_dense_weights(out, inner, int4_path_restored):
    torch.manual_seed(out + inner)
    w = torch.randn(out, inner)
    layer = kernels.PackedInt4Linear.from_float(w, torch.randn(out))
    # the dense weights are w rounded to 16 levels per group of 32: within half a step (plus the bf16
    # rounding of the group's low)
    groups = w.view(out, -1, kernels.INT4_GROUP)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(kernels.INT4_GROUP, dim=1)
    low = groups.amin(-1).abs().repeat_interleave(kernels.INT4_GROUP, dim=1)
    assert ((layer.dense() - w).abs() <= 0.51 * step + low * 2 ** -7).all()
    bad = _misplaced_nibbles(layer)
    for path in int4_path_restored.int4_paths():
        int4_path_restored.set_int4_path(path)
        for rows in (1, 2, 3, 4, 5, 8, 9):
            x = torch.randn(rows, inner)
            expected = _int4_reference(layer, x)
            tolerance = 1e-5 * expected.abs().max()
            got = layer(x)
            assert got.shape == (rows, out) and (got.double() - expected).abs().max() <= tolerance, (path, rows)
            assert (bad(x).double() - expected).abs().max() > 100 * tolerance, (path, rows)  # the control is seen
            alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
            assert torch.equal(got, alone), (path, rows)  # no row depends on the batch


def test_int4_shapes_outside_the_packing_are_refused_and_the_path_is_checked(int4_path_restored, monkeypatch):
    assert kernels.PackedInt4Linear.from_float(torch.randn(20, 64)) is None  # outputs not in sixteens
    assert kernels.PackedInt4Linear.from_float(torch.randn(16, 48)) is None  # inputs not in groups of 32
    monkeypatch.delitem(kernels._state, "int4_path")
    monkeypatch.setenv("VERISPEC_INT4_PATH", "amx")
    with pytest.raises(VerispecError, match="VERISPEC_INT4_PATH=amx is not one of"):
        kernels.int4_path()
    monkeypatch.setenv("VERISPEC_INT4_PATH", "avx2")
    assert kernels.int4_path() == "avx2" and "int4=avx2" in kernels.runtime()


def test_the_int4_path_is_the_faster_measured_once(int4_path_restored, monkeypatch):
    monkeypatch.delitem(kernels._state, "int4_path")
    monkeypatch.delenv("VERISPEC_INT4_PATH", raising=False)
    monkeypatch.setattr(int4_path_restored, "int4_paths", lambda: ["vnni", "avx2"], raising=False)
    timed = iter([{"vnni": 2.0, "avx2": 1.0}])
    chosen = []
    monkeypatch.setattr(kernels, "measure_int4_paths", lambda module, paths: next(timed))
    monkeypatch.setattr(int4_path_restored, "set_int4_path", chosen.append, raising=False)
    assert kernels.int4_path() == "avx2" and kernels.int4_path() == "avx2" and chosen == ["avx2"]


def test_an_int8_target_keeps_its_distribution_under_speculation():
    target = quantize_model(_tiny_target(), "int8")
    sampling = SamplingConfig(1.0, top_k=2)
    counts, exercise = sample_with_exercise(target, lambda: verispec.LayerSkip(skip=[1], k=4), sampling, SAMPLED)
    assert_exercised(exercise, 4)
    assert chi_square_pvalue(counts, exact_distribution(target, sampling)) > ALPHA


@pytest.mark.parametrize("value,message", [("int3", "unknown quantization"), (8, "unknown quantization"),
                                           ("int4", "not offered for targets")])
def test_bad_quantize_values_are_refused(value, message):
    with pytest.raises(VerispecError, match=message):
        check_scheme(value)


def test_quantize_with_the_hf_backend_is_refused_before_loading():
    with pytest.raises(VerispecError, match="needs the native backend"):
        verispec.load_model("no-such-model", backend="hf", quantize="int8")


def test_quantized_draft_refuses_bad_bits_and_an_int8_target():
    with pytest.raises(VerispecError, match="bits must be 8 or 4"):
        verispec.QuantizedDraft(bits=2)
    with pytest.raises(VerispecError, match="'bits' must be an integer >= 4"):
        verispec.parse_drafter("quantized:bits=1")
    with pytest.raises(VerispecError, match="already quantized"):
        verispec.generate(_int8_tiny(vocab=8), input_ids=[1], max_new_tokens=4, drafter=verispec.QuantizedDraft(8))


@pytest.fixture
def folder_model(tmp_path, monkeypatch):
    """A tiny model with a folder (as load_model gives), its quantized cache under tmp_path."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"stand-in weights")

    def make():
        model = tiny_model(vocab=20, seed=3, layers=2, hidden=32)
        model.folder, model.name = folder, "tiny"
        return model
    return make


def _count_quantizations(monkeypatch) -> list[int]:
    calls = []
    original = kernels.quantize_weight

    def counting(weight):
        calls.append(1)
        return original(weight)
    monkeypatch.setattr(kernels, "quantize_weight", counting)
    return calls


def test_the_quantized_cache_is_reused_and_corrupt_or_foreign_files_are_rebuilt(folder_model, monkeypatch, caplog):
    calls = _count_quantizations(monkeypatch)
    first = quantize_model(folder_model(), "int8")
    path = cache_path(folder_model(), "int8")
    assert path.is_file() and len(calls) == 2 * 4 + 1
    second = quantize_model(folder_model(), "int8")
    assert len(calls) == 9  # read from disk, not recomputed
    assert torch.equal(second.layers[0].qkv.rows(), first.layers[0].qkv.rows())
    reference = verispec.generate(first, input_ids=[1, 2], max_new_tokens=8).token_ids

    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated: rebuilt, never loaded
    with caplog.at_level(logging.WARNING):
        rebuilt = quantize_model(folder_model(), "int8")
    assert "unreadable" in caplog.text and len(calls) == 18
    assert verispec.generate(rebuilt, input_ids=[1, 2], max_new_tokens=8).token_ids == reference

    from safetensors.torch import load_file, save_file
    tensors = load_file(str(path))
    save_file(tensors, str(path), metadata={"scheme": "int4", "format": "1"})  # another scheme's file
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        quantize_model(folder_model(), "int8")
    assert "holds scheme int4" in caplog.text and len(calls) == 27
    tensors["layers.0.qkv.weight"] = tensors["layers.0.qkv.weight"][:3]
    save_file(tensors, str(path), metadata={"scheme": "int8", "format": "1"})  # wrong shapes
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        quantize_model(folder_model(), "int8")
    assert "does not match" in caplog.text and len(calls) == 36
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_a_failed_cache_write_leaves_nothing_half_written(folder_model, monkeypatch):
    import safetensors.torch

    def failing(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")
    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    model = quantize_model(folder_model(), "int8")  # still quantized, only not cached
    path = cache_path(folder_model(), "int8")
    assert model.quantization == "int8" and not path.exists() and list(path.parent.iterdir()) == []


def test_quantization_is_recorded_and_shown():
    model = _int8_tiny(vocab=12)
    result = verispec.generate(model, input_ids=[1, 2], max_new_tokens=4)
    assert result.stats.settings["quantization"] == "int8" and "int8 target" in result.stats.summary()
    plain = verispec.generate(tiny_model(vocab=12), input_ids=[1, 2], max_new_tokens=4)
    assert plain.stats.settings["quantization"] is None


def test_bench_compares_quantizations_side_by_side(tmp_path):
    from verispec.bench.config import from_dict

    config = from_dict({"target": "smollm2-135m", "quantize": ["none", "int8"],
                        "methods": [{"name": "prompt-lookup", "k": 3}, {"name": "hf-plain"}]})
    labels = [s.label for s in config.settings]
    assert labels == ["prompt-lookup K=3", "prompt-lookup K=3 @int8", "hf-plain"]
    assert [p.label for p in config.plains] == ["plain", "plain @int8"]
    with pytest.raises(VerispecError, match="'quantize'"):
        from_dict({"target": "x", "quantize": ["int8", "int8"]})
    with pytest.raises(VerispecError, match="unknown quantization"):
        from_dict({"target": "x", "quantize": "fp4"})


def test_bench_runs_bf16_and_int8_targets_in_one_run(tmp_path, tiny_chat_pair, data_dir, monkeypatch):
    from click.testing import CliRunner

    from verispec.bench.records import read_results, summarise
    from verispec.bench.report import tables
    from verispec.cli import main

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    target, draft = tiny_chat_pair
    config = tmp_path / "bench.toml"
    config.write_text(f'''target = "{target}"
dtype = "float32"
quantize = ["none", "int8"]
workloads = ["humaneval"]
prompts = 2
max_new_tokens = 10
warmup_tokens = 0
data_dir = "{data_dir}"
[[methods]]
name = "draft-model"
draft = "{draft}"
draft_quantize = "int8"
k = 3
[[methods]]
name = "quantized"
bits = 8
k = 2
quantize = ["none"]
''')
    out = tmp_path / "results.jsonl"
    result = CliRunner().invoke(main, ["bench", str(config), "-o", str(out), "--no-report"])
    assert result.exit_code == 0, result.output
    _, records = read_results(out)
    by_setting = {}
    for r in records:
        by_setting.setdefault(r["setting"], []).append(r)
    drafted = f"draft-model(draft={draft.name},draft_quantize=int8) K=3"
    assert set(by_setting) == {"plain", "plain @int8", drafted, drafted + " @int8", "quantized(bits=8) K=2"}
    for r in records:
        assert r["quantization"] == ("int8" if r["setting"].endswith("@int8") else None)
        # methods against plain decoding of their own target; int8 plain against bf16 (here fp32) plain
        int8_method = r["quantization"] == "int8" and r["method"] != "plain"
        assert r["compared_with"] == ("plain @int8" if int8_method else "plain")
        if r["method"] != "plain":
            assert r["identical_to_plain"] is True, r["setting"]  # exact greedy equals plain greedy of its target
    rows = tables(summarise(records))["humaneval"]
    speeds = {row[0]: row[9] for row in rows}
    assert speeds["plain"] == "1.00 (baseline)" and "vs plain" not in speeds["plain @int8"]
    assert speeds[drafted + " @int8"].endswith("vs plain @int8")


def test_cli_quantize_flags(tmp_path, tiny_chat_pair, monkeypatch):
    import json

    from click.testing import CliRunner

    from verispec.cli import main

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    target, draft = tiny_chat_pair
    base = ["generate", "hello there", "-m", str(target), "--dtype", "float32", "-n", "6", "--json", "--no-stream"]
    result = CliRunner().invoke(main, base + ["--quantize", "int8", "--draft", str(draft), "--draft-quantize", "int8"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output[result.output.index("{"):])["stats"]
    assert stats["settings"]["quantization"] == "int8" and stats["settings"]["draft_quantization"] == "int8"
    result = CliRunner().invoke(main, base + ["--quantized-draft", "4"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[result.output.index("{"):])["stats"]["settings"]["bits"] == 4
    for extra, message in ((["--quantize", "int8", "--backend", "hf"], "needs the native backend"),
                           (["--quantize", "int3"], "Invalid value for '--quantize'"),
                           (["--draft", str(draft), "--draft-quantize", "int4"], "must be one of none, int8"),
                           (["--quantized-draft", "5"], "bits must be 8 or 4")):
        result = CliRunner().invoke(main, base + extra)
        assert result.exit_code == 2 and message in result.output, (extra, result.output)
        assert "Traceback" not in result.output
