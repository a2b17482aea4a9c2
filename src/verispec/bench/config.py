"""What a benchmark runs: a TOML file or CLI flags, validated into one ``BenchConfig``.

    target = "qwen2.5-coder-1.5b"
    workloads = ["humaneval", "spec_bench"]      # spec_bench = its six categories
    prompts = 2                                  # per workload (per Spec-Bench category)
    max_new_tokens = 64
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
from verispec.errors import VerispecError
from verispec.models.loading import parse_dtype
from verispec.sampling import SamplingConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# method name -> (engine, parameters it takes, parameters it needs)
METHODS: dict[str, tuple[str, dict[str, type | tuple], tuple[str, ...]]] = {
    "draft-model": ("verispec", {"draft": str}, ("draft",)),
    "layer-skip": ("verispec", {"skip": (list, str), "skip_attention": list, "skip_mlp": list}, ()),
    "early-exit": ("verispec", {"layer": (int, str)}, ("layer",)),
    "low-rank": ("verispec", {"rank": int, "energy": float, "targets": list}, ()),
    "prompt-lookup": ("verispec", {"ngram": int}, ()),
    "hf-plain": ("transformers", {}, ()),
    "hf-assisted": ("transformers", {"draft": str}, ("draft",)),
    "hf-prompt-lookup": ("transformers", {"ngram": int}, ()),
}
TOP_LEVEL = {"target", "dtype", "threads", "max_new_tokens", "prompts", "repetitions", "seed", "workloads",
             "data_dir", "chat", "ignore_eos", "warmup_tokens", "sampling", "methods"}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One method with one K and one acceptance rule: a column of the comparison."""

    method: str
    engine: str  # "verispec" or "transformers"
    params: dict[str, Any]
    k: int  # 0 for plain decoding
    acceptance: str = "exact"

    @property
    def label(self) -> str:
        shown = ",".join(f"{key}={_short(value)}" for key, value in self.params.items())
        text = f"{self.method}({shown})" if shown else self.method
        if self.k:
            text += f" K={self.k}"
        if self.acceptance != "exact":
            text += f" [{self.acceptance}]"
        return text

    @property
    def exact(self) -> bool:
        return parse_rule(self.acceptance).exact


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
    threads: int | None = None
    max_new_tokens: int = 64
    prompts: int = 2
    repetitions: int = 1
    seed: int = 0
    data_dir: str | None = None
    chat: str = "auto"  # "auto": chat template when the tokenizer has one (never for code completion); "always"; "never"
    ignore_eos: bool = True  # fixed-length outputs, so speedups compare equal work
    warmup_tokens: int = 8

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["settings"] = [dict(dataclasses.asdict(s), label=s.label) for s in self.settings]
        out["samplings"] = [s.describe() for s in self.samplings]
        return out


def _fail(where: str, message: str) -> VerispecError:
    return VerispecError(f"bench config: {where}: {message}")


def _check_type(where: str, key: str, value: Any, kind: type | tuple) -> None:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return
    if isinstance(value, bool) and bool not in kinds:
        raise _fail(where, f"'{key}' must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise _fail(where, f"'{key}' must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _positive_int(where: str, key: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(where, f"'{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def parse_method(index: int, table: Any) -> list[Setting]:
    where = f"methods[{index}]"
    if not isinstance(table, dict):
        raise _fail(where, "each method is a table with a 'name'")
    name = table.get("name")
    if name == "plain":
        return []  # always run; listing it is harmless
    if name not in METHODS:
        raise _fail(where, f"unknown method {name!r}; choose from plain, {', '.join(METHODS)}")
    engine, allowed, required = METHODS[name]
    where = f"methods[{index}] ({name})"
    params = {}
    for key, value in table.items():
        if key in ("name", "k", "acceptance"):
            continue
        if key not in allowed:
            raise _fail(where, f"unknown key '{key}'; {name} takes {', '.join(['k', 'acceptance', *allowed]) if name != 'hf-plain' else 'no parameters'}")
        _check_type(where, key, value, allowed[key])
        params[key] = value
    missing = [key for key in required if key not in params]
    if missing:
        raise _fail(where, f"missing '{missing[0]}'")
    if name == "layer-skip" and not any(params.get(key) for key in ("skip", "skip_attention", "skip_mlp")):
        raise _fail(where, "give 'skip' (layers or a tuned JSON file), 'skip_attention' or 'skip_mlp'")
    if name == "low-rank" and ("rank" in params) == ("energy" in params):
        raise _fail(where, "give exactly one of 'rank' or 'energy'")
    if name == "hf-plain":
        if "k" in table or "acceptance" in table:
            raise _fail(where, "hf-plain takes no k or acceptance")
        return [Setting(name, engine, params, 0)]
    ks = [_positive_int(where, "k", k) for k in _as_list(table.get("k", 4))]
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
    return [Setting(name, engine, params, k, rule) for k in ks for rule in rules]


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
    settings = [s for i, m in enumerate(methods) for s in parse_method(i, m)]
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
    ignore_eos = raw.get("ignore_eos", True)
    if not isinstance(ignore_eos, bool):
        raise _fail("top level", f"'ignore_eos' must be true or false, got {ignore_eos!r}")
    data_dir = raw.get("data_dir")
    if data_dir is not None and not isinstance(data_dir, str):
        raise _fail("top level", f"'data_dir' must be a path string, got {data_dir!r}")
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise _fail("top level", f"'seed' must be an integer >= 0, got {seed!r}")
    return BenchConfig(
        target=target, settings=tuple(settings), workloads=tuple(workloads), samplings=tuple(samplings),
        dtype=raw.get("dtype", "bfloat16"), threads=threads,
        max_new_tokens=_positive_int("top level", "max_new_tokens", raw.get("max_new_tokens", 64)),
        prompts=_positive_int("top level", "prompts", raw.get("prompts", 2)),
        repetitions=_positive_int("top level", "repetitions", raw.get("repetitions", 1)),
        seed=seed, data_dir=data_dir, chat=chat, ignore_eos=ignore_eos,
        warmup_tokens=_positive_int("top level", "warmup_tokens", raw.get("warmup_tokens", 8), minimum=0))


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
