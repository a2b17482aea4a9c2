"""What a benchmark runs: a TOML file or CLI flags, validated into one ``BenchConfig``.

    target = "qwen2.5-coder-1.5b"
    workloads = ["humaneval", "spec_bench"]      # spec_bench = its six categories
    prompts = 2                                  # per workload (per Spec-Bench category)
    max_new_tokens = 64
    quantize = ["none", "int8"]                  # optional: targets compared side by side
    [[sampling]]                                 # greedy, then T=0.7 (seeded)
    temperature = 0.0
    [[sampling]]
    temperature = 0.7
    [[methods]]
    name = "draft-model"
    draft = "qwen2.5-coder-0.5b"
    k = [3, 5]
    acceptance = ["exact", "lenient:0.5"]        # optional; approximate rules are marked
    [[methods]]
    name = "quantized"                           # the target's own weights in int8 as the draft
    bits = 8
    quantize = ["none"]                          # only for the float target (see top-level 'quantize')
    [[methods]]
    name = "hf-assisted"                         # transformers' own assisted generation
    draft = "qwen2.5-coder-0.5b"
    k = 5

Plain decoding of the target is always run, interleaved with the methods, as the baseline.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from verispec.acceptance import parse_rule
from verispec.adaptive import is_auto
from verispec.drafters.registry import DRAFTERS, DrafterChoice, flag_selections, make_choice, parse_drafter
from verispec.errors import VerispecError
from verispec.models.loading import parse_dtype
from verispec.models.quantize import check_scheme
from verispec.sampling import SamplingConfig
from verispec.validation import integer

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_TARGET = "smollm2-135m"

# transformers' own generate, measured beside verispec: each takes the parameters of the verispec
# drafter it corresponds to, and its fixed K (DrafterSpec.fixed_k) when none is given.
HF_METHODS: dict[str, str | None] = {"hf-plain": None, "hf-assisted": "draft-model", "hf-prompt-lookup": "prompt-lookup"}
TOP_LEVEL = {"target", "dtype", "quantize", "threads", "max_new_tokens", "prompts", "repetitions", "seed", "workloads",
             "data_dir", "chat", "ignore_eos", "warmup_tokens", "roofline", "execute", "sampling", "methods",
             "timing", "prefill_chunk"}
TIMINGS = ("sequential", "interleaved")
# Interleaved timing's default prefill chunk (positions per pass): a long prompt's prefill is stepped in
# lockstep too (verispec.bench.interleave); shorter prompts prefill in one pass as before.
INTERLEAVED_PREFILL_CHUNK = 128


@dataclasses.dataclass(frozen=True)
class Setting:
    """One method with one K and one acceptance rule: a column of the comparison."""

    method: str
    engine: str  # "verispec" or "transformers"
    params: dict[str, Any]
    k: int  # 0 for plain decoding
    acceptance: str = "exact"
    quantize: str | None = None  # the target's quantization (None: its dtype's weights)

    @property
    def label(self) -> str:
        shown = ",".join(f"{key}={_short(value)}" for key, value in self.params.items())
        text = f"{self.method}({shown})" if shown else self.method
        if self.k:
            text += f" K={self.k}"
        if self.acceptance != "exact":
            text += f" [{self.acceptance}]"
        if self.quantize:
            text += f" @{self.quantize}"
        return text

    @property
    def exact(self) -> bool:
        return parse_rule(self.acceptance).exact

    @property
    def choice(self) -> DrafterChoice | None:
        """The drafter this setting builds (None for plain decoding and transformers' engines)."""
        return DrafterChoice(self.method, self.params, self.k) if self.engine == "verispec" and self.k else None

    def pair(self, target: str) -> str:
        """The model pair, or the approximation of the target, in words."""
        if self.quantize:
            target = f"{target} ({self.quantize})"
        if self.method in ("plain", "hf-plain"):
            return target
        counterpart = HF_METHODS.get(self.method, self.method)
        return DrafterChoice(counterpart, self.params, self.k).describe(target)


def _short(value: Any) -> str:
    if isinstance(value, list):
        return "+".join(map(str, value))
    return Path(value).name if isinstance(value, str) and "/" in value else str(value)


PLAIN = Setting("plain", "verispec", {}, 0)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    target: str
    settings: tuple[Setting, ...]
    workloads: tuple[str, ...] = ("humaneval", "spec_bench")
    samplings: tuple[SamplingConfig, ...] = (SamplingConfig(),)
    dtype: str = "bfloat16"
    quantize: tuple[str | None, ...] = (None,)  # target quantizations compared; the first one's plain is the baseline
    threads: int | None = None
    max_new_tokens: int = 64
    prompts: int = 2
    repetitions: int = 1
    seed: int = 0
    data_dir: str | None = None
    chat: str = "auto"  # "auto": chat template when the tokenizer has one (never for code completion); "always"; "never"
    ignore_eos: bool = True  # fixed-length outputs, so speedups compare equal work
    warmup_tokens: int = 8
    roofline: bool = False  # measure the read bandwidth; records then say what share of it decoding reaches
    execute: bool = True  # run HumanEval's tests on each completion (sandboxed: verispec.bench.execution)
    # "sequential": each run whole, one after another (plain first); "interleaved": a prompt's runs advance
    # step by step in lockstep through the text, each timed by its own steps (verispec.bench.interleave)
    timing: str = "sequential"
    prefill_chunk: int = 0  # prompt positions per prefill pass (0: the whole prompt in one)

    @property
    def plains(self) -> tuple[Setting, ...]:
        """Plain decoding at each quantization: the first is the baseline of every other plain run, and
        each quantization's plain run is the baseline of that quantization's methods."""
        return tuple(dataclasses.replace(PLAIN, quantize=q) for q in self.quantize)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["settings"] = [dict(dataclasses.asdict(s), label=s.label) for s in self.settings]
        out["samplings"] = [s.describe() for s in self.samplings]
        return out


def _fail(where: str, message: str) -> VerispecError:
    return VerispecError(f"bench config: {where}: {message}")


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _positive_int(where: str, key: str, value: Any, minimum: int = 1) -> int:
    try:
        return integer(value, f"'{key}'", minimum=minimum)
    except VerispecError as exc:
        raise _fail(where, str(exc)) from None


def parse_method(index: int, table: Any) -> list[Setting]:
    """One ``[[methods]]`` table -> a setting per (K, acceptance rule). Drafter parameters are checked
    by the drafter registry (the same checks as the CLI's), before any model is loaded."""
    where = f"methods[{index}]"
    if not isinstance(table, dict):
        raise _fail(where, "each method is a table with a 'name'")
    name = table.get("name")
    if name == "plain":
        return []  # always run; listing it is harmless
    known = ["plain", *DRAFTERS, *HF_METHODS]
    if name not in DRAFTERS and name not in HF_METHODS:
        raise _fail(where, f"unknown method {name!r}; choose from {', '.join(known)}")
    where = f"methods[{index}] ({name})"
    params = {key: value for key, value in table.items() if key not in ("name", "k", "acceptance", "quantize")}
    if name == "hf-plain":
        if params or "k" in table or "acceptance" in table:
            raise _fail(where, "hf-plain takes no parameters, k or acceptance")
        return [Setting(name, "transformers", {}, 0)]
    engine = "transformers" if name in HF_METHODS else "verispec"
    drafter = HF_METHODS.get(name, name)
    rules = _as_list(table.get("acceptance", "exact"))
    for rule in rules:
        if not isinstance(rule, str):
            raise _fail(where, f"'acceptance' entries are strings like 'lenient:0.5', got {rule!r}")
        try:
            parse_rule(rule)
        except VerispecError as exc:
            raise _fail(where, str(exc)) from None
        if engine == "transformers" and rule != "exact":
            raise _fail(where, "transformers' assisted generation has only its exact rule")
    settings = []
    if engine == "transformers" and any(is_auto(k) for k in _as_list(table.get("k"))):
        raise _fail(where, "k='auto' is verispec's controller; transformers' engines take a fixed K")
    for k in _as_list(table.get("k")):
        if k is None and engine == "transformers":  # no controller there: the drafter's fixed K
            k = DRAFTERS[drafter].fixed_k
        try:
            choice = make_choice(drafter, params, k, where=where)
        except VerispecError as exc:
            raise VerispecError(f"bench config: {exc}") from None
        settings += [Setting(name, engine, dict(choice.params), choice.k, rule) for rule in rules]
    if "quantize" in table and engine != "verispec":
        raise _fail(where, "transformers' engines run their own weights; 'quantize' applies to verispec methods")
    return settings


def parse_sampling(index: int, table: Any) -> SamplingConfig:
    where = f"sampling[{index}]"
    if not isinstance(table, dict):
        raise _fail(where, "each sampling entry is a table like {temperature = 0.7, top_p = 0.9}")
    unknown = set(table) - {"temperature", "top_k", "top_p"}
    if unknown:
        raise _fail(where, f"unknown key '{sorted(unknown)[0]}'; use temperature, top_k, top_p (seeds come from 'seed')")
    try:
        return SamplingConfig(table.get("temperature", 0.0), table.get("top_k", 0), table.get("top_p", 1.0))
    except VerispecError as exc:
        raise _fail(where, str(exc)) from None


def from_dict(raw: dict[str, Any]) -> BenchConfig:
    unknown = set(raw) - TOP_LEVEL
    if unknown:
        raise _fail("top level", f"unknown key '{sorted(unknown)[0]}'; known keys: {', '.join(sorted(TOP_LEVEL))}")
    target = raw.get("target")
    if not isinstance(target, str) or not target:
        raise _fail("top level", "'target' (the model to benchmark) is required")
    methods = raw.get("methods", [])
    if not isinstance(methods, list):
        raise _fail("top level", "'methods' is a list of tables ([[methods]] in TOML)")
    quantize = _quantizations(raw.get("quantize", [None]), "top level")
    settings = []
    for i, m in enumerate(methods):
        parsed = parse_method(i, m)
        # A method runs at every target quantization listed, or at those its own 'quantize' names.
        only = _quantizations(m["quantize"], f"methods[{i}]") if "quantize" in m else quantize
        if not set(only) <= set(quantize):
            raise _fail(f"methods[{i}]", f"'quantize' {list(only)} must be among the top-level 'quantize' "
                                         f"{list(quantize)} (each needs its plain baseline)")
        settings += [dataclasses.replace(s, quantize=q) for q in only for s in parsed if s.engine == "verispec"]
        settings += [s for s in parsed if s.engine != "verispec"]  # transformers runs its own weights
    if len({s.label for s in settings}) != len(settings):
        raise _fail("methods", "the same method setting is listed twice")
    samplings = raw.get("sampling", [{"temperature": 0.0}])
    samplings = [parse_sampling(i, s) for i, s in enumerate(_as_list(samplings))]
    workloads = _as_list(raw.get("workloads", ["humaneval", "spec_bench"]))
    if not workloads or not all(isinstance(w, str) and w for w in workloads):
        raise _fail("top level", "'workloads' is a list of names (humaneval, spec_bench, spec_bench/<category>, FILE.jsonl)")
    try:
        parse_dtype(raw.get("dtype", "bfloat16"))
    except VerispecError as exc:
        raise _fail("top level", str(exc)) from None
    chat = raw.get("chat", "auto")
    if chat not in ("auto", "always", "never"):
        raise _fail("top level", f"'chat' must be auto, always or never, got {chat!r}")
    threads = raw.get("threads")
    if threads is not None:
        _positive_int("top level", "threads", threads)
    ignore_eos = _flag("ignore_eos", raw.get("ignore_eos", True))
    data_dir = raw.get("data_dir")
    if data_dir is not None and not isinstance(data_dir, str):
        raise _fail("top level", f"'data_dir' must be a path string, got {data_dir!r}")
    seed = _positive_int("top level", "seed", raw.get("seed", 0), minimum=0)
    timing = raw.get("timing", "sequential")
    if timing not in TIMINGS:
        raise _fail("top level", f"'timing' must be {' or '.join(TIMINGS)}, got {timing!r}")
    transformers_runs = any(s.engine != "verispec" for s in settings)  # generate() runs whole, one-pass prefill
    if timing == "interleaved" and transformers_runs:
        raise _fail("top level", "timing = 'interleaved' steps verispec's own runs; transformers' generate runs "
                                 "whole (use timing = 'sequential' to compare with it)")
    chunk = raw.get("prefill_chunk", INTERLEAVED_PREFILL_CHUNK if timing == "interleaved" else 0)
    chunk = _positive_int("top level", "prefill_chunk", chunk, minimum=0)
    if chunk and transformers_runs:
        raise _fail("top level", "'prefill_chunk' applies to verispec's runs; transformers' generate prefills "
                                 "in one pass (set prefill_chunk = 0 to compare with it)")
    return BenchConfig(
        target=target, settings=tuple(settings), workloads=tuple(workloads), samplings=tuple(samplings),
        dtype=raw.get("dtype", "bfloat16"), quantize=quantize, threads=threads,
        max_new_tokens=_positive_int("top level", "max_new_tokens", raw.get("max_new_tokens", 64)),
        prompts=_positive_int("top level", "prompts", raw.get("prompts", 2)),
        repetitions=_positive_int("top level", "repetitions", raw.get("repetitions", 1)),
        seed=seed, data_dir=data_dir, chat=chat, ignore_eos=ignore_eos,
        warmup_tokens=_positive_int("top level", "warmup_tokens", raw.get("warmup_tokens", 8), minimum=0),
        roofline=_flag("roofline", raw.get("roofline", False)), execute=_flag("execute", raw.get("execute", True)),
        timing=timing, prefill_chunk=chunk)


def _quantizations(value: Any, where: str) -> tuple[str | None, ...]:
    """'quantize': a scheme or a list of them ("none" for the unquantized target), each once."""
    out = []
    for item in _as_list(value):
        try:
            scheme = check_scheme(item)
        except VerispecError as exc:
            raise _fail(where, f"'quantize': {exc}") from None
        if scheme in out:
            raise _fail(where, f"'quantize' lists {item!r} twice")
        out.append(scheme)
    if not out:
        raise _fail(where, "'quantize' is empty; leave it out for the unquantized target")
    return tuple(out)


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail("top level", f"'{key}' must be true or false, got {value!r}")
    return value


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise VerispecError(f"bench config {path} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise VerispecError(f"bench config {path} is not valid TOML: {exc}") from None


def load_config(path: str | Path | None = None, base: dict[str, Any] | None = None, **overrides: Any) -> BenchConfig:
    """Read a TOML config (or take ``base``) and apply flag values on top (``None`` / empty: not given)."""
    raw = dict(base) if base is not None else read_toml(path) if path is not None else {}
    for key, value in overrides.items():
        if value is not None and value != [] and value != ():
            raw[key] = value
    return from_dict(raw)


def config_from_flags(config_file: str | None, flags: dict[str, Any], ks: str | None, rules: tuple[str, ...],
                      hf: dict[str, Any], temperatures: tuple[float, ...], top_k: int, top_p: float,
                      **overrides: Any) -> BenchConfig:
    """`verispec bench`'s command line -> a ``BenchConfig``: the config file's values, overridden by
    flags; drafter flags (the registry's, as on `verispec generate`) and ``hf`` flags add methods."""
    raw = read_toml(config_file) if config_file else {}
    methods = list(raw.get("methods", []))
    extra: dict[str, Any] = {"k": ks.split(",")} if ks else {}
    rule_list = {"acceptance": list(rules)} if rules else {}
    added = [{"name": name, **params, **extra, **rule_list} for name, params, _ in flag_selections(flags)]
    for text in flags.get("--drafter") or ():  # the spec form carries its own K (or the drafter's default)
        choice = parse_drafter(text)
        added.append({"name": choice.name, **choice.params, "k": choice.k, **rule_list})
    if hf.get("hf_assisted"):
        added.append({"name": "hf-assisted", "draft": hf["hf_assisted"], **extra})
    if hf.get("hf_prompt_lookup") is not None:
        added.append({"name": "hf-prompt-lookup", "ngram": hf["hf_prompt_lookup"], **extra})
    if hf.get("hf_plain"):
        added.append({"name": "hf-plain"})
    if (ks or rules) and not added:
        raise VerispecError("-k and --acceptance apply to methods added by flags (--draft, --layer-skip, ...); "
                            "in a config file, set them per method")
    if not methods and not added:
        raise VerispecError("nothing to compare: give a config file or a method flag "
                            "(--draft, --layer-skip, --early-exit, --low-rank-rank, --prompt-lookup, --drafter, "
                            "--hf-assisted, ...)")
    sampling = [{"temperature": t, **({"top_k": top_k, "top_p": top_p} if t > 0 else {})} for t in temperatures]
    raw.setdefault("target", DEFAULT_TARGET)
    return load_config(base={**raw, "methods": methods + added}, sampling=sampling or None, **overrides)

