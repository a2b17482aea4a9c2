"""The compiled layer stack (kernels/layers.cpp) and the row-by-row attention kernel.

The stack runs a pass's decoder layers in one call; it must give the bits of the layer-by-layer Python
path for every weight kind, layer plan and row count, and a row's attention must not depend on the
other rows of its pass.
"""

from __future__ import annotations

import copy

import pytest
import torch

import verispec
from tests.conftest import missing_setup
from verispec import kernels
from verispec.drafters.self_speculative import draft_steps
from verispec.models.quantize import quantize_model
from verispec.testing import tiny_model


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if not kernels.available():
        missing_setup("verispec's kernels are not available here (no AVX2, no compiler, or VERISPEC_KERNELS=0)")


def _model(kind: str):
    model = tiny_model(vocab=50, seed=3, layers=4, hidden=64, context=256)
    if kind == "int8":
        return quantize_model(model, "int8")
    if kind == "bf16":
        return model.to_weight_dtype(torch.bfloat16)
    if kind == "bias":  # Qwen-style qkv biases
        for layer in model.layers:
            layer.qkv.bias = torch.nn.Parameter(torch.randn(layer.qkv.out_features) * 0.3, requires_grad=False)
        return model
    return model


PREFIX = 12


def _pass(model, monkeypatch, fused: bool, rows: int, steps=None, projections=None, head=None):
    """Logits of ``rows`` new positions after a ``PREFIX``-token prefix, and the cache they leave."""
    monkeypatch.setenv("VERISPEC_FUSED_LAYERS", "1" if fused else "0")
    tokens = torch.randint(0, 50, (PREFIX + rows,), generator=torch.Generator().manual_seed(rows))
    cache = model.new_cache(PREFIX + rows)
    model.forward(tokens[:PREFIX], cache, 0)
    with torch.inference_mode():
        hidden = model.run_layers(model.embed_tokens(tokens[PREFIX:]), cache, PREFIX, steps or model.all_layers,
                                  projections)
        logits = model.logits(hidden, head)
    return logits, cache.keys[:, :, :PREFIX + rows].clone(), cache.values[:, :, :PREFIX + rows].clone()


@pytest.mark.parametrize("kind", ["int8", "bf16", "fp32", "bias"])
@pytest.mark.parametrize("rows", [1, 3, 9, 16, 40, 100, 200])  # 100, 200: prompts (torch's attention, MLP chunks)
def test_the_stack_gives_the_python_paths_bits(kind, rows, monkeypatch):
    model = _model(kind)
    python = _pass(model, monkeypatch, False, rows)
    fused = _pass(model, monkeypatch, True, rows)
    assert model._stack(None) is not None  # the fused run really took the stack
    for a, b in zip(fused, python):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind,prompt_path", [("int8", None), ("bf16", "bf16"), ("bf16", "fp32"), ("bf16", "chunks"),
                                               ("bias", None)])
def test_a_prompt_from_position_zero_takes_the_stack_with_the_python_paths_bits(kind, prompt_path, monkeypatch):
    if prompt_path is not None:
        monkeypatch.setitem(kernels._state, "bf16_prompt", prompt_path)
    model = _model(kind)
    tokens = torch.randint(0, 50, (150,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for fused in (False, True):
        monkeypatch.setenv("VERISPEC_FUSED_LAYERS", "1" if fused else "0")
        cache = model.new_cache(150)
        logits[fused] = (model.forward(tokens, cache, 0), cache.keys.clone())
    assert torch.equal(logits[True][0], logits[False][0]) and torch.equal(logits[True][1], logits[False][1])


def test_a_bf16_prompt_on_the_fp32_path_is_computed_in_fp32(monkeypatch):
    """The "fp32" prompt path widens the bf16 weights and multiplies fp32 activations: its logits are those
    of the same model held in fp32 (every bf16 value is an fp32 one) up to fp32 rounding, with the
    fused stack and without it. Control: the "bf16" path, which rounds the activations to bf16, is
    far off that reference (so the comparison can see a prompt computed in bf16)."""
    model = _model("bf16")
    widened = copy.deepcopy(model).to_weight_dtype(torch.float32)
    tokens = torch.randint(0, 50, (150,), generator=torch.Generator().manual_seed(1))
    reference = widened.forward(tokens, widened.new_cache(150), 0)
    error = {}
    for path in ("fp32", "bf16"):
        monkeypatch.setitem(kernels._state, "bf16_prompt", path)
        for fused in (False, True):
            monkeypatch.setenv("VERISPEC_FUSED_LAYERS", "1" if fused else "0")
            logits = model.forward(tokens, model.new_cache(150), 0)
            error[path, fused] = ((logits - reference).abs().max() / reference.abs().max()).item()
    assert error["fp32", False] < 1e-5 and error["fp32", True] < 1e-5
    assert error["bf16", False] > 100 * max(error["fp32", False], 1e-7)
    assert error["bf16", True] > 100 * max(error["fp32", True], 1e-7)


@pytest.mark.parametrize("kind", ["int8", "fp32"])
def test_a_model_without_bf16_matrices_never_measures_the_bf16_prompt_paths(kind, monkeypatch):
    """The bf16 prompt paths are measured (~1 s) for bf16 models only: an fp32 or int8 model's prompt and
    decode passes, fused or not, never ask."""
    monkeypatch.delitem(kernels._state, "bf16_prompt", raising=False)
    monkeypatch.delenv("VERISPEC_PROMPT_PATH", raising=False)
    monkeypatch.setattr(kernels, "interleaved_medians", lambda fns, rounds: pytest.fail("measured the bf16 paths"))
    model = _model(kind)
    tokens = torch.randint(0, 50, (150,), generator=torch.Generator().manual_seed(2))
    for fused in (False, True):
        monkeypatch.setenv("VERISPEC_FUSED_LAYERS", "1" if fused else "0")
        cache = model.new_cache(151)
        model.forward(tokens, cache, 0)
        model.forward(tokens[:1], cache, 150)
    assert "bf16_prompt" not in kernels._state


def test_layer_plans_and_swapped_matrices_take_the_stack_with_the_same_bits(monkeypatch):
    model = _model("bf16")
    plan = draft_steps(4, skip=[1], skip_attention=[2], skip_mlp=[3])  # whole layer, attention only, MLP only
    assert _pass(model, monkeypatch, True, 5, steps=plan)[0].equal(_pass(model, monkeypatch, False, 5, steps=plan)[0])
    draft = verispec.QuantizedDraft(bits=8, k=2)  # the target's matrices in int8, swapped in for the draft pass
    p = draft.plan_for(model)
    fused = _pass(model, monkeypatch, True, 3, projections=p.projections, head=p.head)
    assert model._stack(p.projections) is not None
    assert torch.equal(fused[0], _pass(model, monkeypatch, False, 3, projections=p.projections, head=p.head)[0])
    assert not torch.equal(fused[0], _pass(model, monkeypatch, True, 3)[0])  # the swap really ran


def test_the_comparison_sees_a_wrong_later_row(monkeypatch):
    """Negative control: a Python path that differs only at the third new position (its rotary angle
    nudged) is told apart there, and the rows before it still match."""
    model = _model("fp32")
    fused = _pass(model, monkeypatch, True, 6)[0]
    cos, signed_sin = model._rope_cache["table"]
    cos = cos.clone()
    cos[PREFIX + 2] *= 1.01  # the third new row's position (later rows attend to its key)
    model._rope_cache["table"] = (cos, signed_sin)
    wrong = _pass(model, monkeypatch, False, 6)[0]
    assert [torch.equal(fused[t], wrong[t]) for t in range(3)] == [True, True, False]


def test_unsupported_matrices_take_the_python_path():
    model = _model("fp32")
    low_rank = verispec.LowRank(rank=4, k=2).plan_for(model)
    assert model._stack(low_rank.projections) is None  # factor pairs: the Python path runs them


def test_a_module_swapped_after_a_pass_rebuilds_the_stack(monkeypatch):
    """Quantizing a model that already ran must not leave the stack on the old float matrices."""
    model = _model("fp32")
    _pass(model, monkeypatch, True, 2)
    before = model._stack(None)
    quantize_model(model, "int8")
    assert model._stack(None) is not before
    assert torch.equal(_pass(model, monkeypatch, True, 2)[0], _pass(_model("int8"), monkeypatch, True, 2)[0])


def _reference_attention(q, keys, values, start):
    H, T, D = q.shape
    G = H // keys.shape[0]
    out = torch.empty(T, H, D, dtype=torch.float64)
    for h in range(H):
        for t in range(T):
            k, v = keys[h // G, :start + t + 1].double(), values[h // G, :start + t + 1].double()
            out[t, h] = torch.softmax(k @ q[h, t].double(), 0) @ v
    return out.reshape(T, H * D)


@pytest.mark.parametrize("head_dim", [64, 20, 128])
@pytest.mark.parametrize("start", [0, 5, 37])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (7, 1), (4, 4)])  # query heads per KV head: 3, 7 (3 + 3 + 1), 1
def test_attention_rows_match_float64_and_do_not_depend_on_the_batch(head_dim, start, heads, kv_heads):
    g = torch.Generator().manual_seed(head_dim + start)
    H, KV, T = heads, kv_heads, 13
    q = torch.randn(H, T, head_dim, generator=g) * 0.4
    keys, values = torch.randn(KV, start + T + 3, head_dim, generator=g), torch.randn(KV, start + T + 3, head_dim, generator=g)
    module = kernels._load()
    out = module.causal_attention(q, keys, values, start)
    assert (out.double() - _reference_attention(q, keys, values, start)).abs().max() < 1e-5
    for t in range(T):  # each row alone, as a one-token step at its position computes it
        assert torch.equal(module.causal_attention(q[:, t:t + 1].contiguous(), keys, values, start + t)[0], out[t]), t


def test_attention_keeps_nan_and_survives_large_scores():
    module = kernels._load()
    q, keys, values = torch.randn(2, 3, 64), torch.randn(1, 10, 64), torch.randn(1, 10, 64)
    q[0, 1, 0] = float("nan")
    out = module.causal_attention(q, keys, values, 7)
    assert torch.isnan(out[1, :64]).all() and torch.isfinite(out[[0, 2]]).all() and torch.isfinite(out[1, 64:]).all()
    q = torch.randn(2, 3, 64) * 200  # scores in the thousands: e^(s - max) underflows to 0 for most keys
    got = module.causal_attention(q, keys, values, 7)
    assert torch.isfinite(got).all() and (got.double() - _reference_attention(q, keys, values, 7)).abs().max() < 1e-4


def test_int8_paths_by_row_count_keep_the_weights_layout():
    stored = kernels.weight_layout(kernels.few_row_path())
    for rows in (1, 2, 3, 5, 8, 16, 40, 64, kernels.INVARIANT_ROWS):
        assert kernels.weight_layout(kernels.int8_path(rows)) == stored or kernels.int8_path(rows) == "intmm"
    prompt = kernels.int8_path(kernels.INVARIANT_ROWS + 1)
    assert prompt in ("amx", "intmm", kernels.few_row_path()) and (
        prompt == "intmm" or kernels.weight_layout(prompt) == stored)


@pytest.mark.parametrize("few_rows", ["vnni", "amx"])
def test_a_prompt_takes_amx_tiles_whichever_packed_path_won_for_few_rows(few_rows, monkeypatch):
    if "amx" not in kernels.int8_paths():
        pytest.skip("this CPU has no AMX tiles")
    # One row's VNNI and AMX timings are close; whichever wins, a prompt's packed weights go to the tiles
    # (torch's _int_mm would first unpack every matrix: 1.2 of a 700-token prefill's 4.5 s on the 1.5B).
    monkeypatch.setitem(kernels._state, "int8_path", few_rows)
    monkeypatch.setitem(kernels._state, "int8_table", [few_rows] * len(kernels.ROW_COUNTS))
    monkeypatch.delitem(kernels._state, "prompt_int8_path", raising=False)
    assert kernels.int8_path(kernels.INVARIANT_ROWS + 1) == "amx"
    monkeypatch.setitem(kernels._state, "int8_path", "vnni-rows")  # weights stored as rows: oneDNN's GEMM
    monkeypatch.delitem(kernels._state, "prompt_int8_path")
    monkeypatch.setattr(kernels, "measure_int8_paths", lambda paths, **kw: {"intmm": 1.0, "vnni-rows": 2.0})
    assert kernels.int8_path(kernels.INVARIANT_ROWS + 1) == "intmm"


@pytest.mark.parametrize("faster", ["intmm", "avx2-packed"])
def test_a_prompt_without_tiles_takes_the_faster_of_int_mm_and_the_few_row_kernel(faster, monkeypatch):
    # Without VNNI torch's _int_mm took ~37x as long as the AVX2 kernel (a 40-token prompt cost ~4 s);
    # where it is the faster one (oneDNN on VNNI), prompts keep it. Measured once, then remembered.
    monkeypatch.setattr(kernels, "int8_paths", lambda: ("avx2-packed", "avx2", "intmm"))
    monkeypatch.setitem(kernels._state, "int8_path", "avx2-packed")
    monkeypatch.delitem(kernels._state, "prompt_int8_path", raising=False)
    asked = []

    def measure(paths, rows=(1, 8), **kw):
        asked.append((paths, rows))
        return {p: 1.0 if p == faster else 30.0 for p in paths}

    monkeypatch.setattr(kernels, "measure_int8_paths", measure)
    assert kernels.int8_path(kernels.INVARIANT_ROWS + 1) == faster
    assert kernels.int8_path(500) == faster and asked == [(("intmm", "avx2-packed"), (kernels.PROMPT_ROWS,))]
    assert kernels.int8_path(kernels.INVARIANT_ROWS) != "intmm"  # verification rows stay on the few-row kernel


def test_a_model_that_ran_can_be_copied_and_the_copy_runs_its_own_stack(monkeypatch):
    model = _model("int8")
    before = _pass(model, monkeypatch, True, 3)
    twin = copy.deepcopy(model)  # the stack (compiled, over the original's tensors) is not copied
    assert torch.equal(_pass(twin, monkeypatch, True, 3)[0], before[0])
    assert twin._stack(None) is not model._stack(None)


def test_row_count_paths_are_measured_on_the_models_own_matrices(monkeypatch):
    import time

    linears = [kernels.Int8Linear.from_float(torch.randn(48, 64)) for _ in range(3)]
    monkeypatch.setattr(kernels, "_same_layout_paths", lambda: ("fast", "slow"))
    seen = []

    def accumulate(q, weight, row_sums, path):  # "slow" is slow from 4 rows up, on these very matrices
        seen.append(weight)
        if path == "slow" and q.shape[0] >= 4:
            time.sleep(0.002)
        if path == "fast" and q.shape[0] < 4:
            time.sleep(0.002)

    monkeypatch.setattr(kernels, "int8_accumulate", accumulate)
    monkeypatch.delitem(kernels._state, "int8_table", raising=False)
    kernels.measure_row_counts(linears)
    assert kernels._state["int8_table"] == ["slow" if m < 4 else "fast" for m in kernels.ROW_COUNTS]
    assert {id(w) for w in seen} == {id(layer.weight) for layer in linears}
    kernels.measure_row_counts([kernels.Int8Linear.from_float(torch.randn(16, 64))])  # once per process
    assert kernels._state["int8_table"][0] == "slow"
    # A large model: the sweep stops once it has covered more than the last-level cache.
    monkeypatch.delitem(kernels._state, "int8_table")
    monkeypatch.setattr(kernels, "SWEEP_MIN_BYTES", 2 * 48 * 64)
    monkeypatch.setattr("verispec.machine.last_level_cache_bytes", lambda: 0)
    seen.clear()
    kernels.measure_row_counts(linears)
    assert {id(w) for w in seen} == {id(layer.weight) for layer in linears[:2]}


def test_the_few_row_path_is_chosen_on_weights_streamed_from_memory(monkeypatch):
    # In the cache "rows" wins; streamed over matrices that overflow the last-level cache "packed" does
    # (AVX2-only EPYC: the rows kernel 0.81 ms against packed 0.91 on one cached matrix, packed 1.6-2x
    # faster streamed). A path more than 2x slower in the cache ("far") is not measured again.
    calls = []

    def measure(paths, rows=(1, 8), out=4096, inner=1536, repeats=5, matrices=1):
        calls.append((paths, matrices))
        streamed = matrices > 1
        table = {"rows": 1.0 if not streamed else 2.0, "packed": 1.2 if not streamed else 1.1, "far": 5.0}
        return {p: table[p] for p in paths}

    monkeypatch.setattr(kernels, "int8_paths", lambda: ("packed", "rows", "far"))
    monkeypatch.setattr(kernels, "measure_int8_paths", measure)
    monkeypatch.delenv("VERISPEC_INT8_PATH", raising=False)
    monkeypatch.setattr("verispec.machine.last_level_cache_bytes", lambda: 64 << 20)
    monkeypatch.delitem(kernels._state, "int8_path", raising=False)
    assert kernels.few_row_path() == "packed"
    assert calls[0] == (("packed", "rows", "far"), 1)
    assert calls[1][0] == ("packed", "rows") and calls[1][1] * 4096 * 1536 >= 1.25 * (64 << 20)
    assert kernels.stream_matrices() == calls[1][1]
    monkeypatch.setattr("verispec.machine.last_level_cache_bytes", lambda: 0)  # unknown: the floor
    assert kernels.stream_matrices() * 4096 * 1536 >= kernels.STREAM_BYTES[0]
    monkeypatch.setattr("verispec.machine.last_level_cache_bytes", lambda: 1 << 40)  # capped
    assert (kernels.stream_matrices() - 1) * 4096 * 1536 < kernels.STREAM_BYTES[1]


def test_the_last_level_cache_is_read_where_linux_reports_it():
    from verispec.machine import last_level_cache_bytes

    size = last_level_cache_bytes()
    assert size == 0 or size >= 1 << 20  # a real L2/L3 is at least a megabyte; 0 where sysfs is absent
