"""Optional compiled kernels: bf16- and int8-weight matrix products over a few rows.

On CPUs without native bf16 arithmetic (AVX2 machines), torch's bf16 matmul costs grow linearly
with the number of rows, which makes verifying K drafts cost about K decode steps. The kernel in
``bf16_gemv.cpp`` reads each weight row once for up to 16 input rows. ``int8_linear.cpp`` does the
same for int8 weights with per-row int8 activations and int32 accumulation (AMX, AVX-512 VNNI and
AVX2 paths, chosen by CPU feature and a quick measurement; see ``int8_linear``); ``int4_linear.cpp``
a draft's int4 weights (``PackedInt4Linear``); ``attention.cpp``
computes the attention of a few rows row by row, so no row's bits depend on the others, and
``prompt_attention.cpp`` a prompt's on AMX bf16 tiles at about fp32's accuracy. The extension is
compiled on first use (about a minute, cached by torch in ~/.cache/torch_extensions); if that fails,
or on CPUs without AVX2/FMA, or with ``VERISPEC_KERNELS=0``, everything runs on torch's own ops
(same int8 results, slower).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MAX_ROWS = 16
SOURCES = ("attention.cpp", "bf16_gemv.cpp", "int4_linear.cpp", "int8_linear.cpp", "layers.cpp", "module.cpp",
           "prompt_attention.cpp")
_state: dict[str, object] = {}


def _load() -> object | None:
    if "module" in _state:
        return _state["module"]
    module = None
    if os.environ.get("VERISPEC_KERNELS", "1") == "0":
        log.info("VERISPEC_KERNELS=0: using torch's bf16 matmul")
    elif torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("CPU lacks AVX2/FMA: using torch's bf16 matmul")
    else:
        try:
            from torch.utils.cpp_extension import load

            log.info("loading verispec's kernels (compiled on first use only: about a minute)")
            sources = [str(Path(__file__).with_name(n)) for n in SOURCES]
            # torch rebuilds when a source or a flag changes, not a header: the headers' digest is a flag.
            headers = _digest("*.h")
            # -ffp-contract=off: no fused multiply-adds the torch fallback would not also do.
            with _build_lock():
                module = load("verispec_kernels", sources, extra_ldflags=["-fopenmp"],
                              extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off",
                                            f"-DVERISPEC_HEADERS={headers}"])
        except Exception as exc:  # no compiler, no ninja: slower, still correct
            log.warning("could not compile verispec's kernels (%s); using torch's ops", exc)
    _state["module"] = module
    return module


@contextlib.contextmanager
def _build_lock():
    """Hold an OS lock on the kernels' build folder, and clear torch's lock file there if it is stale.

    torch takes its build lock (a file in the build folder) on every load, compiling or not, and only
    the process that created the file removes it: one killed while it held it (a server stopped during
    its first start, a Ctrl-C in the minute-long compile) leaves it behind, and every later process
    waits on it forever. Every load here takes this lock first, and the OS releases it however its
    holder ends, so whoever holds it knows that a torch lock file it finds was left by a dead process."""
    try:
        import fcntl
        from torch.utils.cpp_extension import _get_build_directory

        folder = Path(_get_build_directory("verispec_kernels", verbose=False))
    except (ImportError, AttributeError, OSError):  # no flock (Windows), or torch moved its helper
        yield
        return
    with open(folder / "verispec.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = folder / "lock"
        if stale.exists():
            log.warning("removing %s, left by a process that ended while it loaded the kernels", stale)
            stale.unlink(missing_ok=True)
        yield  # the lock goes with the handle


def _digest(*patterns: str) -> str:
    """A short digest of the kernel files matching ``patterns``."""
    files = [p for pattern in patterns for p in sorted(Path(__file__).parent.glob(pattern))]
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()[:16]


def runtime() -> str:
    """What this process's arithmetic runs on, for keys of measured costs: a digest of the kernels' sources
    (or "torch" without them), the switches that change which code runs, and the int8 paths chosen per
    row count once they have been (a verification pass on VNNI instead of AMX tiles costs twice as much),
    and the int4 draft path once chosen."""
    if _load() is None:
        return "torch"
    digest = _state.get("sources") or _state.setdefault("sources", _digest("*.cpp", "*.h", "*.py"))
    switches = ",".join(f"{name}={os.environ.get(name, '')}" for name in ("VERISPEC_FUSED_LAYERS", "VERISPEC_INT8_PATH",
                                                                           "VERISPEC_TILE_ATTENTION",
                                                                           "VERISPEC_INT4_PATH"))
    table = _state.get("int8_table")
    int4 = _state.get("int4_path")
    return (f"{digest};{switches}" + (f";int8={','.join(table)}" if table else "")  # type: ignore[arg-type]
            + (f";int4={int4}" if int4 else ""))


def available() -> bool:
    return _load() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for activations of any float dtype against weights of another (result in x's dtype).

    bf16 weights and at most ``MAX_ROWS`` rows take the compiled path; everything else torch's.
    """
    if weight.dtype is torch.bfloat16 and x.numel() // x.shape[-1] <= MAX_ROWS and x.shape[-1] % 8 == 0:
        module = _load()
        if module is not None and weight.is_contiguous():
            out = module.bf16_linear(x, weight)
            return out if bias is None else out + bias
    # As 2-D rows: a [1, T, I] slice of a longer [1, S, I] keeps a stride on its first dimension that
    # sends torch's matmul down a batched path ~10x slower than one matrix product.
    rows = x.reshape(-1, x.shape[-1])
    if x.dtype is weight.dtype and (bias is None or bias.dtype is weight.dtype):
        out = F.linear(rows, weight, bias)
    else:
        out = prompt_linear(rows, weight).to(x.dtype)  # e.g. a bf16 prefill; biases stay fp32
        out = out if bias is None else out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


class Linear(torch.nn.Linear):
    """nn.Linear whose forward goes through ``linear`` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def interleaved_medians(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each function's median wall time over ``rounds`` rounds that call every function once in turn
    (after one warm-up call each): a shared machine's slow moments fall on all of them alike."""
    import time

    runs: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            begin = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - begin)
    return {name: sorted(times)[len(times) // 2] for name, times in runs.items()}


def median_seconds(fn, repeats: int) -> float:
    """``fn``'s median wall time over ``repeats`` calls, after one warm-up call."""
    return interleaved_medians({"fn": fn}, repeats)["fn"]


PROMPT_PATHS = ("bf16", "fp32", "chunks")  # how a bf16 model's prompt products run (``bf16_prompt_path``)


def bf16_prompt_path() -> str:
    """How a bf16 prompt (more than ``INVARIANT_ROWS`` rows) runs its matrix products, measured once per
    process on a prompt-sized product (``VERISPEC_PROMPT_PATH`` fixes one):

    - "bf16": torch's bf16 matmul in one pass (CPUs with bf16 matrix units run it ~15x faster than
      16-row chunks);
    - "fp32": one pass of torch's fp32 matmul with the weights widened to fp32 for the call (exact:
      every bf16 value is an fp32 value); on AVX2 CPUs, where torch's bf16 matmul converts element by
      element, this ran SmolLM2's prompt products ~25% faster than the chunks (AMD EPYC);
    - "chunks": the compiled few-row kernel ``MAX_ROWS`` rows at a time.

    A prompt is prefilled the same way in plain and in speculative runs, so the choice changes speed,
    never whether they agree."""
    if "bf16_prompt" in _state:
        return _state["bf16_prompt"]  # type: ignore[return-value]
    path = os.environ.get("VERISPEC_PROMPT_PATH")
    if path is not None and path not in PROMPT_PATHS:
        from verispec.errors import VerispecError

        raise VerispecError(f"VERISPEC_PROMPT_PATH={path!r}: expected one of {', '.join(PROMPT_PATHS)}")
    module = _load()
    if path is None and module is None:
        path = "bf16"
    elif path is None:
        # A small model's MLP product and a larger one's, over a prompt chunk of MLP rows (128): the
        # paths' order depends on both (at 66 rows and one 4096 x 1536 matrix the fp32 path and the
        # chunks measured even on an AVX2 EPYC, where SmolLM2's prompts ran 25% faster in fp32).
        products = [(torch.randn(3072, 576).bfloat16(), torch.randn(128, 576)),
                    (torch.randn(1536, 4096).bfloat16(), torch.randn(128, 4096))]

        def each(product):
            return lambda: [product(x, weight) for weight, x in products]

        paths = {
            "bf16": each(lambda x, weight: F.linear(x.bfloat16(), weight).float()),
            "fp32": each(lambda x, weight: F.linear(x, weight.float())),
            "chunks": each(lambda x, weight: torch.cat([module.bf16_linear(x[b:b + MAX_ROWS], weight)
                                                         for b in range(0, x.shape[0], MAX_ROWS)])),
        }
        timings = interleaved_medians(paths, 5)
        path = min(timings, key=timings.__getitem__)
        log.info("bf16 prompts: %s (%s)", path, ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in timings.items()))
    _state["bf16_prompt"] = path
    return path


def prompt_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A prompt's product of fp32 rows with bf16 (or other lower-precision float) weights, by
    ``bf16_prompt_path``: fp32 arithmetic on widened weights, or torch's in the weights' dtype."""
    if weight.dtype is torch.bfloat16 and bf16_prompt_path() == "fp32":
        return F.linear(rows, weight.float())
    return F.linear(rows.to(weight.dtype), weight).to(rows.dtype)


def fused_layers() -> bool:
    """Whether few-row passes run their decoder layers in one compiled call (``layers.cpp``), which
    gives the same bits as the layer-by-layer Python path; ``VERISPEC_FUSED_LAYERS=0`` turns it off
    (for comparisons)."""
    return os.environ.get("VERISPEC_FUSED_LAYERS", "1") != "0" and _load() is not None


def layer_stack(parts: list[torch.nn.Module], config) -> object | None:
    """A compiled ``LayerStack`` over decoder layers given as [attn_norm, mlp_norm, qkv, o, gate_up, down]
    per layer, or None when a matrix is none of a float ``Linear``, an ``Int8Linear`` and a
    ``PackedInt4Linear``."""
    empty = torch.empty(0)

    def product(module: torch.nn.Module) -> list[torch.Tensor] | None:
        """[weight, scale, row sums, bias] as layers.cpp reads one matrix (empty where there is none)."""
        if isinstance(module, Int8Linear):
            tensors = [module.weight, module.scale, module.row_sums]
        elif isinstance(module, PackedInt4Linear):
            int4_path()  # chosen once, before the first product
            tensors = [module.packed, module.groups, empty]
        elif type(module) in (Linear, torch.nn.Linear):
            tensors = [module.weight, empty, empty]
        else:
            return None
        return tensors + [empty if module.bias is None else module.bias]

    layers = []
    for i in range(0, len(parts), 6):
        attn_norm, mlp_norm, *matrices = parts[i:i + 6]
        qkv, o, gate_up, down = products = [product(m) for m in matrices]
        if any(p is None for p in products):
            return None
        # the tensors themselves: a later ``param.data = ...`` shows through
        layers.append([attn_norm.weight, *qkv, *o, mlp_norm.weight, *gate_up, *down])
    return _load().LayerStack(layers, config.num_heads, config.num_kv_heads, config.head_dim,
                              config.rms_norm_eps, config.head_dim ** -0.5)


# Passes of at most this many rows (decode, verification of up to MAX_K candidates plus the bonus row) are
# computed row by row: no row's bits depend on the others. Longer ones are prompts.
MAX_K = 64
INVARIANT_ROWS = MAX_K + 1


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of q [H, T, D] (scaled, rotated) over keys/values [KV, start + T, D]:
    [T, H * D]. Row t sees positions 0 .. start + t; query head h uses KV head h // (H // KV).

    Up to ``INVARIANT_ROWS`` rows, each row is computed alone in a fixed order (the compiled kernel,
    or one torch pass per row shaped exactly like a one-token step), so its bits do not depend on how
    many rows share the pass. Longer passes (prompts) run on AMX bf16 tiles where the CPU has them
    (``prompt_attention.cpp``: each fp32 product as three bf16 ones, about fp32's accuracy), else torch's
    fused scaled_dot_product_attention: faster, and a prompt is processed the same way whether the run is
    plain or speculative.
    """
    H, T, D = q.shape
    KV = keys.shape[0]
    if T <= INVARIANT_ROWS:
        module = _load()
        if module is not None:
            return module.causal_attention(q, keys, values, start)
        return torch.cat([_grouped_attention(q[:, t:t + 1], keys[:, :start + t + 1], values[:, :start + t + 1])
                          for t in range(T)])
    module = _load()
    if module is not None and module.prompt_attention_supported(D):  # a prompt on AMX bf16 tiles (bf16x3)
        return module.prompt_attention(q, keys, values, start)
    # A prompt: torch's fused attention (q is already scaled), masked so row t sees positions <= start + t.
    mask = None if start == 0 else torch.ones(T, start + T, dtype=torch.bool).tril(diagonal=start)
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, is_causal=start == 0,
                                         scale=1.0, enable_gqa=KV != H)
    return out[0].transpose(0, 1).reshape(T, H * D)


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One row's grouped-query attention as batched matmuls over KV groups (cheaper than SDPA for a row):
    query heads j*G .. j*G+G-1 share KV head j, as transformers' repeat_kv lays them out."""
    H, T, D = q.shape
    KV = keys.shape[0]
    grouped = q.reshape(KV, (H // KV) * T, D)  # [KV, G*T, D]
    probs = torch.softmax(torch.bmm(grouped, keys.transpose(1, 2)), dim=-1)  # [KV, G*T, S]
    return torch.bmm(probs, values).view(H, T, D).transpose(0, 1).reshape(T, H * D)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of fp32 activations (one compiled call for decode-sized inputs)."""
    module = _load()
    if module is not None and x.dtype is weight.dtype is torch.float32:  # per row: the same bits whatever T
        return module.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def gate_up_silu(projection: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [gate | up] projection of ``x``. An int8 projection without a bias computes
    it in one compiled call: for a prompt on AMX tiles the silu is applied as the sums leave the tiles,
    and the [rows, 2 * intermediate] product is never written (the same bits as the product, then
    ``silu_mul``)."""
    module = _load()
    if module is not None and isinstance(projection, Int8Linear) and projection.bias is None:
        rows = x.numel() // x.shape[-1]
        return module.int8_gate_up_silu(x, projection.weight, projection.scale, projection.row_sums, int8_path(rows))
    return silu_mul(projection(x))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused [..., 2 * intermediate] projection, gate first."""
    module = _load()
    if module is not None and gate_up.dtype is torch.float32:
        return module.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ------------------------------------------------------------------------------------------------ int8

# The compiled few-row paths: "amx" (Intel AMX tiles: 16 rows x 16 channels x 64 inputs per tile
# multiply), "vnni" (AVX-512 VNNI) and "avx2-packed" (AVX2 multiply-adds), all on weights packed
# [O/16, I/4, 16, 4]: one load of 16 channels x 4 inputs per step (two on AVX2), a block's weights one
# contiguous stream; "vnni-rows" and "avx2" (weights as rows, each read once for up to 4 rows); then
# torch's _int_mm for many rows.
INT8_PATHS = ("amx", "vnni", "vnni-rows", "avx2-packed", "avx2", "intmm")
PACKED_PATHS = ("amx", "vnni", "avx2-packed")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: scale = max|x| / 127, q = round-half-even(x * (127 / max|x|)).

    Rows of zeros get scale 1; a row holding NaN or infinity gets a NaN scale (its products are NaN,
    which the sampler refuses). Compiled when available; the torch version below gives the same bits.
    """
    module = _load()
    if module is not None:
        q, scale = module.quantize_rows(x)
        return q, scale
    x2 = x.reshape(-1, x.shape[-1]).float()
    amax = x2.abs().amax(dim=-1)
    finite = torch.isfinite(x2).all(dim=-1)
    usable = finite & (amax > 0)
    inv = torch.where(usable, torch.tensor(127.0) / torch.where(usable, amax, 1.0), 0.0)
    q = torch.round(torch.nan_to_num(x2, 0.0, 0.0, 0.0) * inv[:, None]).clamp(-127, 127).to(torch.int8)
    scale = torch.where(usable, amax / 127.0, torch.where(finite, 1.0, float("nan")))
    return q, scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 of weight [O, I] -> (int8 [O, I], fp32 scale [O], int32 row sums [O])."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, 1.0)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous(), q.sum(dim=1, dtype=torch.int32)


def int8_paths() -> tuple[str, ...]:
    """The int8 accumulation paths this machine can run (compiled ones only when the kernels built)."""
    module = _load()
    return tuple(module.int8_paths()) if module is not None else ("torch",)


def pack_vnni(weight: torch.Tensor) -> torch.Tensor:
    """int8 [O, I] rows -> [ceil(O/16), I/4, 16, 4], O padded with zero channels to 16s and I with zero
    inputs to 64s (AMX tiles take 64 inputs at a time): the "amx" and "vnni" paths' layout."""
    out, inner = weight.shape
    padded = torch.nn.functional.pad(weight, (0, -inner % 64, 0, -out % 16))
    return padded.view(padded.shape[0] // 16, 16, padded.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()


def unpack_vnni(packed: torch.Tensor, out: int, inner: int) -> torch.Tensor:
    """The inverse of ``pack_vnni``: int8 [O, I] rows."""
    blocks, steps = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * 16, steps * 4)[:out, :inner].contiguous()


def weight_layout(path: str) -> str:
    return "packed" if path in PACKED_PATHS else "rows"


def int8_accumulate(q: torch.Tensor, weight: torch.Tensor, row_sums: torch.Tensor, path: str) -> torch.Tensor:
    """int32 accumulators [M, O] of int8 rows q [M, I] against int8 weight (rows [O, I], or packed by
    ``pack_vnni``; converted to the layout ``path`` reads) on ``path``."""
    if weight.dim() == 4 and weight_layout(path) == "rows":
        weight = unpack_vnni(weight, row_sums.numel(), q.shape[1])
    elif weight.dim() == 2 and weight_layout(path) == "packed":
        weight = pack_vnni(weight)
    if path == "torch":
        return torch._int_mm(q, weight.t())
    module = _load()
    if module is None:
        raise RuntimeError(f"int8 path '{path}' needs the compiled kernels")
    return module.int8_accumulate(q, weight, row_sums, path)


def choose_path(variable: str, paths: tuple[str, ...], what: str,
                measure: Callable[[tuple[str, ...]], dict[str, float]]) -> str:
    """The path the environment ``variable`` fixes (refused unless it is one of ``paths``), the only one, or
    the fastest by ``measure(paths)`` (median seconds by path; logged)."""
    forced = os.environ.get(variable)
    if forced:
        if forced not in paths:
            from verispec.errors import VerispecError

            raise VerispecError(f"{variable}={forced} is not one of this machine's {what} paths: {', '.join(paths)}")
        return forced
    if len(paths) == 1:
        return paths[0]
    timings = measure(paths)
    chosen = min(timings, key=timings.__getitem__)
    log.info("%s path: %s (%s)", what, chosen, ", ".join(f"{p} {t * 1e3:.2f} ms" for p, t in timings.items()))
    return chosen


def few_row_path() -> str:
    """The int8 path for at most ``INVARIANT_ROWS`` rows: ``VERISPEC_INT8_PATH`` if set, else the fastest of
    this CPU's paths on a decode-sized product, measured once per process. Every path gives the same
    integers, so the choice changes speed only, never a result."""
    if "int8_path" in _state:
        return _state["int8_path"]  # type: ignore[return-value]

    def measure(paths: tuple[str, ...]) -> dict[str, float]:
        timings = measure_int8_paths(paths)
        close = tuple(p for p in paths if timings[p] <= 2 * min(timings.values()))
        if len(close) > 1:
            # One matrix stays in the cache; a model's weights stream from memory, where the ranking can
            # turn (AVX2-only EPYC: rows 0.81 ms against packed 0.91 in cache, packed 1.6-2x faster
            # streamed). The close ones again over matrices that overflow the last-level cache.
            timings = measure_int8_paths(close, matrices=stream_matrices())
        return timings

    chosen = choose_path("VERISPEC_INT8_PATH", int8_paths(), "int8", measure)
    _state["int8_path"] = chosen
    return chosen


ROW_COUNTS = (1, 2, 4, 8, 16)  # the row counts ``int8_path`` measures


def int8_path(rows: int) -> str:
    """The int8 path for a product over ``rows`` rows: among the paths that read the weights in the layout
    ``few_row_path`` stored them in, the fastest at the nearest measured row count at or above ``rows``
    (measured once per process on products larger than the CPU's L2 cache, as a model's weights are;
    VERISPEC_INT8_PATH fixes one path). More than ``INVARIANT_ROWS`` rows (a prompt) take
    ``prompt_int8_path``. Every path gives the same integers."""
    if rows > INVARIANT_ROWS:
        return prompt_int8_path()
    table = _state.get("int8_table")
    if table is None:
        table = _state["int8_table"] = _row_count_table()
    return table[next((i for i, m in enumerate(ROW_COUNTS) if m >= rows), len(ROW_COUNTS) - 1)]


PROMPT_ROWS = 64  # prompt_int8_path measures products over this many rows (more than a few-row kernel's tile)


def prompt_int8_path() -> str:
    """The int8 path for a prompt (more than ``INVARIANT_ROWS`` rows). AMX tiles where the CPU has them and
    the weights are packed (whichever path won for few rows: the VNNI and AMX timings for one row are
    often a coin flip). Otherwise the faster, measured once per process on a [256, 1536] product over
    ``PROMPT_ROWS`` rows, of torch's _int_mm (oneDNN's GEMM; packed weights are unpacked for it) and the
    few-row path, which takes any number of rows in the layout the weights are stored in. Without VNNI,
    _int_mm took ~37x as long (AVX2-only EPYC, 3072 x 576 over 128 rows: 126 ms against avx2-packed's
    3.4 ms), and a 40-token prompt cost the int8 SmolLM2 ~4 s. VERISPEC_INT8_PATH fixes the few-row
    path only."""
    if "prompt_int8_path" in _state:
        return _state["prompt_int8_path"]  # type: ignore[return-value]
    few = few_row_path()
    packed = weight_layout(few) == "packed"
    if packed and "amx" in int8_paths():
        chosen = "amx"
    elif few in ("intmm", "torch"):
        chosen = "intmm"
    else:
        timings = measure_int8_paths(("intmm", few), rows=(PROMPT_ROWS,), out=256, repeats=3)
        chosen = min(timings, key=timings.get)
        log.info("int8 prompt path: %s (%s)", chosen, ", ".join(f"{p} {t * 1e3:.2f} ms" for p, t in timings.items()))
    _state["prompt_int8_path"] = chosen
    return chosen


def _same_layout_paths() -> tuple[str, ...]:
    """The compiled paths that read the weights in the layout ``few_row_path`` stored them in ("intmm" is
    the prompt path); one path only when VERISPEC_INT8_PATH fixes it."""
    chosen = few_row_path()
    if os.environ.get("VERISPEC_INT8_PATH"):
        return (chosen,)
    return tuple(p for p in int8_paths() if p != "intmm" and weight_layout(p) == weight_layout(chosen))


def _row_count_table() -> list[str]:
    """Without a model's weights to measure on (``measure_row_counts``): synthetic matrices."""
    same_layout = _same_layout_paths()
    if len(same_layout) < 2:
        return [few_row_path()] * len(ROW_COUNTS)
    timings = {m: measure_int8_paths(same_layout, rows=(m,), matrices=4, repeats=3) for m in ROW_COUNTS}
    return _log_table([min(timings[m], key=timings[m].get) for m in ROW_COUNTS], "synthetic matrices")


def _log_table(table: list[str], what: str) -> list[str]:
    log.info("int8 path by rows (%s): %s", what, ", ".join(f"{m}: {p}" for m, p in zip(ROW_COUNTS, table)))
    return table


SWEEP_MIN_BYTES = 256 << 20  # measure_row_counts sweeps at least this many bytes of weights


def measure_row_counts(linears: list["Int8Linear"]) -> None:
    """Choose ``int8_path``'s path per row count on a model's own int8 matrices, once per process (the
    first quantized model loaded): each path times a sweep over them, streamed from memory as a
    forward pass streams them. Synthetic matrices of a few MB stay in a large L3 cache and misjudge that regime:
    on a 2-core Xeon with a 300 MB L3 they rated the VNNI kernel level with AMX tiles at 4 rows, where a
    pass of the 1.5B model took 88 ms on VNNI and 52 ms on tiles. The sweep covers the first matrices
    up to 1.25x the last-level cache (at least 256 MB; all of a smaller model): enough to stream from
    memory, a fraction of a large model's load time. Every path gives the same integers."""
    if "int8_table" in _state or _load() is None or not linears:
        return
    same_layout = _same_layout_paths()
    if len(same_layout) < 2:
        return
    import time

    from verispec.machine import last_level_cache_bytes

    budget, swept = max(SWEEP_MIN_BYTES, int(1.25 * last_level_cache_bytes())), 0
    for count, layer in enumerate(linears, 1):
        swept += layer.weight.numel()
        if swept >= budget:
            linears = linears[:count]
            break

    generator = torch.Generator().manual_seed(0)
    inputs = {m: {n: torch.randint(-127, 128, (m, n), dtype=torch.int8, generator=generator)
                  for n in {layer.in_features for layer in linears}} for m in ROW_COUNTS}

    def sweep(m: int, path: str) -> float:
        begin = time.perf_counter()
        for layer in linears:
            int8_accumulate(inputs[m][layer.in_features], layer.weight, layer.row_sums, path)
        return time.perf_counter() - begin

    sweep(1, same_layout[0])  # warm-up
    table = []
    for m in ROW_COUNTS:
        timings = {path: min(sweep(m, path), sweep(m, path)) for path in same_layout}
        table.append(min(timings, key=timings.get))
    _state["int8_table"] = _log_table(table, f"measured on {len(linears)} model matrices")


STREAM_BYTES = (32 << 20, 128 << 20)  # stream_matrices: at least, at most this many bytes of weights


def stream_matrices(size: int = 4096 * 1536) -> int:
    """How many int8 matrices of ``size`` bytes overflow the last-level cache (1.25x it, within
    ``STREAM_BYTES``), so that a sweep over them reads them from memory."""
    from verispec.machine import last_level_cache_bytes

    low, high = STREAM_BYTES
    return -(-min(max(int(1.25 * last_level_cache_bytes()), low), high) // size)


def measure_int8_paths(paths: tuple[str, ...], rows: tuple[int, ...] = (1, 8), out: int = 4096,
                       inner: int = 1536, repeats: int = 5, matrices: int = 1) -> dict[str, float]:
    """Median seconds of each path over ``rows`` (summed) on ``matrices`` [out, inner] products in turn
    (~6 MB of weights each; several exceed the L2 cache, as a model's layers do; copies of one random
    matrix: the values do not change the speed)."""
    first = torch.randint(-127, 128, (out, inner), dtype=torch.int8)
    rows_weights = [first] + [first.clone() for _ in range(matrices - 1)]
    sums = [w.sum(dim=1, dtype=torch.int32) for w in rows_weights]
    timings = {}
    for path in paths:
        weights = [pack_vnni(w) if weight_layout(path) == "packed" else w for w in rows_weights]
        total = 0.0
        for m in rows:
            q = torch.randint(-127, 128, (m, inner), dtype=torch.int8)
            total += median_seconds(lambda: [int8_accumulate(q, w, s, path) for w, s in zip(weights, sums)],
                                     repeats)
        timings[path] = total
    return timings


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_sums: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``x [..., I]`` through int8 ``weight`` ([O, I] rows, or packed for the "vnni" path) with
    per-channel ``scale``: per-row int8 activations, int32 sums, then (acc * x_scale) * w_scale (+ bias)
    in fp32.

    A row's result is the same bits whatever else is in ``x`` and whichever path computed it: up to
    ``INVARIANT_ROWS`` rows take the path ``int8_path`` chose for that many rows, more (a prompt) AMX
    tiles or torch's ``_int_mm``.
    """
    rows = x.numel() // x.shape[-1]
    module = _load()
    if module is not None:
        return module.int8_linear(x, weight, scale, row_sums, bias, int8_path(rows))
    q, x_scale = quantize_rows(x)
    y = int8_accumulate(q, weight, row_sums, "torch").float() * x_scale[:, None] * scale
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], scale.shape[0])


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights (per-output-channel scales) and dynamic per-row int8 activations."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, row_sums: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        """``weight``: int8 [O, I] rows; kept in the layout this machine's few-row path reads."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if _load() is not None and weight_layout(few_row_path()) == "packed":
            weight = pack_vnni(weight)
        self.register_buffer("weight", weight)
        # Copies: these may be views of a memory-mapped file (the quantized cache, the checkpoint), which
        # one kept view would keep mapped whole.
        self.register_buffer("scale", scale.clone())
        self.register_buffer("row_sums", row_sums.clone())
        self.register_buffer("bias", None if bias is None else bias.float().clone())

    def rows(self) -> torch.Tensor:
        """The int8 weights as [O, I] rows, whatever the stored layout."""
        if self.weight.dim() == 2:
            return self.weight
        return unpack_vnni(self.weight, self.out_features, self.in_features)

    def dense(self) -> torch.Tensor:
        """The weights the int8 ones stand for, fp32 [O, I] (what a derived draft, e.g. low rank, starts from)."""
        return self.rows().float() * self.scale[:, None]

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        return cls(*quantize_weight(weight), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight, self.scale, self.row_sums, self.bias)


# ------------------------------------------------------------------------------------------------ int4

INT4_GROUPS = (128, 64, 32)  # group sizes along the input, largest that divides it


class Int4Linear(torch.nn.Module):
    """int4 weights (asymmetric, one bf16 scale and zero per group of inputs) through torch's packed
    int4 kernel with bf16 activations. For drafts only: its rows depend on the batch, which a draft
    may (the target verifies whatever it proposes), a target may not.
    """

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int, out_features: int,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", None if bias is None else bias.float())
        self.group, self.out_features, self.in_features = group, out_features, scales_and_zeros.shape[0] * group

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int4Linear | None":
        """None when no group size divides the input width (the caller keeps another form)."""
        out, inner = weight.shape
        group = next((g for g in INT4_GROUPS if inner % g == 0), None)
        if group is None:
            return None
        padded = -(-out // 16) * 16  # the packing wants output channels in sixteens
        w = torch.cat([weight.float(), weight.new_zeros(padded - out, inner).float()]).view(padded, inner // group, group)
        low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-8)
        q = torch.round((w - low) / scale).clamp(0, 15).to(torch.int32).view(padded, inner)
        zero = low + 8 * scale  # the kernel dequantizes (q - 8) * scale + zero
        scales_and_zeros = torch.stack([scale.view(padded, -1).t(), zero.view(padded, -1).t()], dim=-1)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        return cls(packed, scales_and_zeros.to(torch.bfloat16).contiguous(), group, out, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_and_zeros)
        y = y[:, : self.out_features].float()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


INT4_GROUP = 32  # PackedInt4Linear's group of inputs (int4_linear.cpp's kGroup)


def int4_path() -> str:
    """The path of every ``PackedInt4Linear`` product in this process: "vnni" (AVX-512 VNNI) or "avx2",
    the faster measured once over the draft-sized products of ``measure_int4_paths`` where the CPU has
    both (``VERISPEC_INT4_PATH`` fixes one). The two give the same integer sums per group; their fp32
    sums of groups differ in order only (16 lanes against 2 x 8), which a draft may."""
    if "int4_path" in _state:
        return _state["int4_path"]  # type: ignore[return-value]
    module = _load()
    if module is None:
        raise RuntimeError("int4 drafts need the compiled kernels")
    chosen = choose_path("VERISPEC_INT4_PATH", tuple(module.int4_paths()), "int4",
                         lambda paths: measure_int4_paths(module, paths))
    module.set_int4_path(chosen)
    _state["int4_path"] = chosen
    return chosen


def measure_int4_paths(module, paths: tuple[str, ...], out: int = 3072, inner: int = 576,
                       repeats: int = 5) -> dict[str, float]:
    """Median seconds of each int4 path over one row (a draft step), sweeping copies of an [out, inner]
    matrix that overflow the last-level cache."""
    first = PackedInt4Linear.from_float(torch.randn(out, inner))
    copies = stream_matrices(out * inner * 5 // 8)
    layers = [first] + [PackedInt4Linear(first.packed.clone(), first.groups.clone(), None) for _ in range(copies - 1)]
    x = torch.randn(1, inner)

    def sweep(path: str) -> Callable[[], object]:
        def run() -> None:
            module.set_int4_path(path)
            for layer in layers:
                module.int4_linear(x, layer.packed, layer.groups, None)
        return run

    return interleaved_medians({path: sweep(path) for path in paths}, repeats)


class PackedInt4Linear(torch.nn.Module):
    """A draft's int4 weights in ``int4_linear.cpp``'s packed layout: asymmetric, a bf16 (scale, low) pair
    per group of ``INT4_GROUP`` inputs (w ~ scale * u + low, u in 0..15), int8 activations per row, integer
    sums within a group. Reads 0.625 bytes a weight against int8's 1. For drafts only (int4 changes the
    model); each row is computed alone all the same."""

    def __init__(self, packed: torch.Tensor, groups: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("groups", groups)
        self.register_buffer("bias", None if bias is None else bias.float())
        self.out_features, self.in_features = packed.shape[0] * 16, packed.shape[1] * 8

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        out, inner = weight.shape
        return out % 16 == 0 and inner % INT4_GROUP == 0

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "PackedInt4Linear | None":
        """None when the shape does not fit the packing (outputs in sixteens, inputs in groups of 32)."""
        if not cls.supports(weight):
            return None
        out, inner = weight.shape
        w = weight.float().view(out, inner // INT4_GROUP, INT4_GROUP)
        low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
        # the pair the kernel reads (bf16), and u fitted to those rounded values
        scale = ((high - low) / 15).clamp(min=1e-8).bfloat16().float()
        low = low.bfloat16().float()
        u = torch.round((w - low) / scale).clamp(0, 15).to(torch.uint8).view(out // 16, 16, inner // 8, 2, 4)
        packed = (u[:, :, :, 0] | (u[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()  # [O/16, I/8, 16, 4]
        pair = torch.stack([scale.view(out // 16, 16, -1), low.view(out // 16, 16, -1)], dim=2)  # [O/16, 16, 2, I/32]
        groups = pair.permute(0, 3, 2, 1).to(torch.bfloat16).contiguous()  # [O/16, I/32, 2, 16]
        return cls(packed, groups, bias)

    def dense(self) -> torch.Tensor:
        """The fp32 weights these stand for (scale * u + low), for references and tests."""
        nib = torch.stack([self.packed & 15, self.packed >> 4], dim=3)  # [O/16, I/8, 16, 2, 4]
        u = nib.permute(0, 2, 1, 3, 4).reshape(self.out_features, self.in_features).float()
        pair = self.groups.float().permute(0, 3, 2, 1).reshape(self.out_features, 2, -1)  # [O, 2, I/32]
        scale = pair[:, 0].repeat_interleave(INT4_GROUP, dim=1)
        low = pair[:, 1].repeat_interleave(INT4_GROUP, dim=1)
        return scale * u + low

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        int4_path()
        return _load().int4_linear(x, self.packed, self.groups, self.bias)


def dense_weight(module: torch.nn.Module) -> torch.Tensor:
    """A linear layer's [O, I] weights as floats, whether it is float, int8 or packed int4."""
    return module.dense() if isinstance(module, (Int8Linear, PackedInt4Linear)) else module.weight
