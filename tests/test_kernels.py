"""The compiled few-row kernels against torch's own operations (the slow references)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import verispec
from tests.conftest import missing_setup
from verispec import kernels


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if not kernels.available():
        missing_setup("verispec's kernel is not available here (no AVX2, no compiler, or VERISPEC_KERNELS=0)")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16])
@pytest.mark.parametrize("out_features,in_features", [(24, 16), (200, 64), (96, 1544)])
def test_bf16_linear_matches_fp32_reference(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(1, rows, in_features, generator=g)  # fp32 activations, as the runtime uses
    expected = F.linear(x.double(), weight.double(), bias.double())
    got = kernels.linear(x, weight, bias)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def rows_or_channels_not_alone(linear, weight: torch.Tensor, x: torch.Tensor) -> list[tuple]:
    """The (rows, row) and (rows, "channels") cases where ``linear``'s bits differ from a row or a channel
    computed alone."""
    failures = []
    for rows in range(1, x.shape[0] + 1):
        batch = linear(x[:rows], weight)
        failures += [(rows, r) for r in range(rows) if not torch.equal(linear(x[r:r + 1], weight)[0], batch[r])]
        alone = torch.cat([linear(x[:rows], weight[o:o + 1]) for o in range(weight.shape[0])], dim=1)
        failures += [] if torch.equal(alone, batch) else [(rows, "channels")]
    return failures


@pytest.mark.parametrize("out_features", [1, 7, 29, 200])
def test_bf16_rows_do_not_depend_on_the_batch_or_on_the_channels_computed_beside_them(out_features):
    """Each row of a batch, and each channel of a product, must come out of the few-row kernel with the bits
    it has alone (whatever tiling of rows and channels a kernel uses), or a verification pass would not
    score the tokens plain decoding scores. Negative control: a product whose rows after the first go
    another way (fp64, rounded) is caught, at later rows only."""
    g = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 40, generator=g).bfloat16()
    x = torch.randn(kernels.MAX_ROWS, 40, generator=g)
    module = kernels._load()
    assert rows_or_channels_not_alone(module.bf16_linear, weight, x) == []

    def later_rows_another_way(rows, w):
        out = module.bf16_linear(rows, w)
        if rows.shape[0] > 1:
            out[1:] = (rows[1:].double() @ w.double().T).float()
        return out

    caught = rows_or_channels_not_alone(later_rows_another_way, weight, x)
    assert caught and all(isinstance(row, str) or row >= 1 for _, row in caught)


@pytest.mark.parametrize("path", ["bf16", "fp32"])
def test_more_rows_than_the_kernel_takes_fall_back_to_torch(path, monkeypatch):
    weight = torch.randn(32, 16).bfloat16()
    x = torch.randn(kernels.MAX_ROWS + 3, 16)

    class NoKernel:  # any call into the compiled kernel for this input would be a failure
        def bf16_linear(self, *args):
            raise AssertionError("the compiled kernel took more rows than it can")

    monkeypatch.setitem(kernels._state, "module", NoKernel())
    monkeypatch.setitem(kernels._state, "bf16_prompt", path)
    got = kernels.linear(x, weight)
    assert got.shape == (kernels.MAX_ROWS + 3, 32) and got.dtype == torch.float32
    if path == "bf16":
        # An independent reference: the same bf16-rounded activations, in fp64 (torch's bf16 path rounds
        # its output to bf16, so allow one bf16 ulp of the largest value).
        expected = x.bfloat16().double() @ weight.double().T
        assert (got.double() - expected).abs().max() <= 2 ** -7 * expected.abs().max()
    else:  # fp32 activations against the widened weights: fp32 rounding only
        expected = x.double() @ weight.double().T
        assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_the_prompt_path_is_measured_once_or_set_by_the_environment(monkeypatch):
    """``bf16_prompt_path`` takes the fastest of the three measured paths, once a process;
    ``VERISPEC_PROMPT_PATH`` fixes one without measuring, and a name that is none of them is an error."""
    monkeypatch.delitem(kernels._state, "bf16_prompt", raising=False)
    monkeypatch.delenv("VERISPEC_PROMPT_PATH", raising=False)
    calls = []
    timed = iter([{"bf16": 3.0, "fp32": 1.0, "chunks": 2.0}])
    monkeypatch.setattr(kernels, "interleaved_medians", lambda fns, rounds: calls.append(sorted(fns)) or next(timed))
    assert kernels.bf16_prompt_path() == "fp32" and calls == [sorted(kernels.PROMPT_PATHS)]
    assert kernels.bf16_prompt_path() == "fp32"  # not measured again (the timings would run out)
    for path in kernels.PROMPT_PATHS:
        monkeypatch.delitem(kernels._state, "bf16_prompt")
        monkeypatch.setenv("VERISPEC_PROMPT_PATH", path)
        monkeypatch.setattr(kernels, "interleaved_medians", lambda fns, rounds: pytest.fail("measured"))
        assert kernels.bf16_prompt_path() == path
    monkeypatch.delitem(kernels._state, "bf16_prompt")
    monkeypatch.setenv("VERISPEC_PROMPT_PATH", "fp16")
    with pytest.raises(verispec.VerispecError, match="VERISPEC_PROMPT_PATH='fp16'"):
        kernels.bf16_prompt_path()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_slice_of_a_longer_prompt_goes_through_one_matrix_product(dtype, monkeypatch):
    weight = torch.randn(48, 32).to(dtype)
    x = torch.randn(1, kernels.MAX_ROWS + 40, 32)[:, 3:]  # a [1, T, I] view with a stride on dim 0
    calls = []
    real = F.linear
    monkeypatch.setattr(kernels.F, "linear", lambda a, *rest: calls.append(a.dim()) or real(a, *rest))
    got = kernels.linear(x, weight)
    # As rows: torch's matmul sends such a 3-D view down a batched path ~10x slower than one product.
    assert calls == [2] and got.shape == (1, kernels.MAX_ROWS + 37, 48) and got.dtype == torch.float32
    assert torch.equal(got, kernels.linear(x.contiguous(), weight))


def test_interleaved_medians_time_every_function_in_turn():
    order = []
    medians = kernels.interleaved_medians({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 3)
    assert order == ["a", "b"] * 4 and set(medians) == {"a", "b"} and all(v >= 0 for v in medians.values())


def test_rms_norm_and_silu_mul_match_torch():
    x = torch.randn(1, 5, 576)
    weight = torch.randn(576)
    assert torch.allclose(kernels.rms_norm(x, weight, 1e-5), F.rms_norm(x, (576,), weight, 1e-5), atol=1e-5)
    gate_up = torch.randn(1, 5, 2 * 96)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(kernels.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6)


@pytest.mark.parametrize("width", [8, 13, 45, 100, 1536, 8960])  # 16/32-wide blocks, 8-wide blocks, tails
@pytest.mark.parametrize("lanes", [8, 16])  # the AVX2 loop, and the AVX-512 one where the CPU has it
def test_quantize_rows_gives_the_torch_bits_in_vector_blocks_and_tails(width, lanes, monkeypatch):
    x = torch.randn(6, width) * 3
    x[1, :] = torch.arange(width) - width / 2 + 0.5  # ties (k + 0.5) * 127 / max: round half to even
    x[2, -1] = float("inf")  # in the scalar tail (or the last vector block)
    x[3, 0] = float("nan")  # in the first vector block
    x[4] = 0.0
    x[5, -1] = -2 * x[5].abs().max()  # the row's largest magnitude in the last element (a tail, for most widths)
    compiled = kernels._load().quantize_rows_with(x, lanes)
    monkeypatch.setitem(kernels._state, "module", None)
    reference = kernels.quantize_rows(x)
    assert torch.equal(compiled[0], reference[0])
    assert torch.equal(compiled[1].isnan(), reference[1].isnan()) and torch.equal(compiled[1][~compiled[1].isnan()],
                                                                                reference[1][~reference[1].isnan()])


@pytest.mark.parametrize("half", [13, 96])
def test_silu_mul_matches_torch_with_tails_and_extremes(half):
    gate_up = torch.randn(3, 2 * half) * 4
    gate_up[0, 0], gate_up[0, 1], gate_up[0, half - 1] = -200.0, 200.0, float("nan")
    gate, up = gate_up.chunk(2, dim=-1)
    got, expected = kernels.silu_mul(gate_up), F.silu(gate) * up
    assert torch.isnan(got[0, half - 1]) and torch.allclose(got.nan_to_num(), expected.nan_to_num(), rtol=1e-6, atol=1e-6)


def test_silu_mul_and_rms_norm_give_an_element_the_same_bits_wherever_it_falls():
    """silu_mul runs 16 lanes (AVX-512), then 8, then a padded tail; rms_norm sums squares in 16 partial
    sums: shifting a row must move its results and change none of their bits (45 = 16 + 16 + 8 + 5)."""
    torch.manual_seed(0)
    gate, up = torch.randn(45) * 4, torch.randn(45)
    base = kernels.silu_mul(torch.cat([gate, up])[None])[0]
    for shift in range(1, 16):
        g, u = torch.cat([torch.randn(shift), gate]), torch.cat([torch.randn(shift), up])
        assert torch.equal(kernels.silu_mul(torch.cat([g, u])[None])[0, shift:], base), shift
    x, weight = torch.randn(4, 1536), torch.randn(1536)
    alone = torch.cat([kernels.rms_norm(x[i:i + 1], weight, 1e-6) for i in range(4)])
    assert torch.equal(kernels.rms_norm(x, weight, 1e-6), alone)


def test_a_build_lock_left_by_a_killed_process_does_not_stall_the_next_load():
    """torch's build lock file, as a process killed while loading the kernels leaves it: the next process
    loads them anyway (torch alone would wait on that file forever: CI hangs until its time runs out)."""
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    stale = Path(_get_build_directory("verispec_kernels", verbose=False)) / "lock"
    with kernels._build_lock():  # no load in flight while the stale file is made
        stale.touch()
    code = "from verispec import kernels; assert kernels.available()"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        left = stale.exists()
    except subprocess.TimeoutExpired:
        pytest.fail("the load waited on a build lock nobody holds")
    finally:
        with kernels._build_lock():
            stale.unlink(missing_ok=True)  # never leave it behind for the rest of the suite
    assert done.returncode == 0, done.stderr
    assert not left, "the load left torch's lock file behind"
