"""The drafter registry: every drafter's name, typed parameters and constructor, in one place.

Everything that builds a drafter from words goes through here: CLI flags (``--layer-skip 3,5``), the
spec form (``--drafter layer-skip:skip=3+5,k=2``), bench configs (``[[methods]] name = "layer-skip"``),
the server's per-request choice, and Python (``make_choice("layer-skip", {"skip": [3, 5]})``).
Adding a drafter is one module that defines its class and a ``DrafterSpec``, plus one ``register``
line in ``verispec/drafters/__init__.py``.

Parsing validates everything it can before any model is loaded: a bad parameter fails fast.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from verispec.adaptive import parse_k
from verispec.drafters.base import DEFAULT_K
from verispec.errors import VerispecError
from verispec.validation import is_int, is_number, number

ModelLoader = Callable[..., Any]  # (model name / path, quantize=None) -> a loaded DecoderModel


@dataclasses.dataclass(frozen=True)
class Param:
    """One drafter parameter.

    ``kind``: "int" (>= ``minimum``), "float" (in the open interval ``bounds``), "str", "ints" (a list
    of integers >= 0), "strs" (a list of names), "ints|file" (a list of integers, or a JSON file
    written by ``verispec tune``), "int|file" (an integer >= ``minimum``, or such a file).
    In text (CLI, spec strings) lists are written 3,5,7 or 3+5+7.
    """

    name: str
    kind: str
    help: str
    default: Any = None  # the constructor's default, for help text (left to the constructor, never filled in)
    required: bool = False
    flag: str | None = None  # the CLI flag that sets it
    selects: bool = False  # giving the flag selects this drafter (others only refine it)
    minimum: int = 1
    bounds: tuple[float, float] | None = None
    choices: tuple[str, ...] | None = None  # the values a "str" may take

    def parse(self, value: Any, where: str, files: bool = True) -> Any:
        """A value from text (CLI, spec) or from typed data (TOML, JSON, Python) -> its checked form.

        ``files=False`` refuses settings files (the server: a client must not make it read paths)."""
        what = f"{where}: '{self.name}'"
        kind = self.kind
        if kind.endswith("|file") and isinstance(value, (str, Path)) and _looks_like_file(str(value)):
            if not files:
                raise VerispecError(f"{what}: settings files can be named only where the models are loaded "
                                    f"(the command line), not here; give the values")
            path = Path(value).expanduser()
            if not path.is_file():
                raise VerispecError(f"{what}: settings file {path} does not exist")
            return str(path)
        if kind in ("int", "int|file"):
            return _at_least(_int(value, what), self.minimum, what)
        if kind == "float":
            low, high = self.bounds or (float("-inf"), float("inf"))
            return number(_float(value, what), what, low, high, low_open=True, high_open=True)
        if kind == "str":
            if not isinstance(value, (str, Path)) or not str(value):
                raise VerispecError(f"{what} must be a non-empty string, got {value!r}")
            if self.choices is not None and str(value).lower() not in self.choices:
                raise VerispecError(f"{what} must be one of {', '.join(self.choices)}, got {value!r}")
            return str(value).lower() if self.choices is not None else str(value)
        if kind in ("ints", "ints|file"):
            items = _split(value) if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)):
                raise VerispecError(f"{what} must be a list of integers, got {value!r}")
            return [_at_least(_int(v, what), 0, what) for v in items]
        if kind == "strs":
            items = _split(value) if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) and v for v in items):
                raise VerispecError(f"{what} must be a list of names, got {value!r}")
            return list(items)
        raise AssertionError(f"unknown parameter kind {kind}")


def _looks_like_file(text: str) -> bool:
    return text.endswith(".json") or "/" in text or Path(text).expanduser().is_file()


def _split(text: str) -> list[str]:
    return [part.strip() for part in re.split(r"[,+]", text) if part.strip()]


def _int(value: Any, what: str) -> int:
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    if not is_int(value):
        raise VerispecError(f"{what} must be an integer, got {value!r}")
    return value


def _float(value: Any, what: str) -> float:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise VerispecError(f"{what} must be a number, got {value!r}") from None
    if not is_number(value):
        raise VerispecError(f"{what} must be a number, got {value!r}")
    return float(value)


def _at_least(value: int, minimum: int, what: str) -> int:
    if value < minimum:
        raise VerispecError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """How to build one kind of drafter from checked parameters.

    ``build(params, k, load)`` returns the drafter; ``k`` is None when not given (the drafter's
    default, or a tuned file's), and ``load`` loads a model by name (only drafters that name a model
    in ``model_params`` use it). ``describe(params, target)`` says in words what drafts for
    ``target``: the model pair, or the approximation.
    """

    name: str
    summary: str
    params: tuple[Param, ...]
    build: Callable[[dict[str, Any], int | None, ModelLoader | None], Any]
    describe: Callable[[dict[str, Any], str], str]
    default_k: int | str = DEFAULT_K  # K when none is given
    # The K where a fixed one is needed and none is given: transformers' own engines measured beside
    # verispec (hf-assisted, hf-prompt-lookup) have no controller.
    fixed_k: int = 4
    model_params: tuple[str, ...] = ()  # parameters that name a model to load
    # Cheap enough to build for one request (no model to load, no factorisation, no quantized copy):
    # the server lets a request choose it freely; others only as the server was started with them.
    per_request: bool = True

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise VerispecError(f"drafter '{self.name}' has no parameter '{name}'; it takes "
                            f"{', '.join(['k', *(p.name for p in self.params)])}")


DRAFTERS: dict[str, DrafterSpec] = {}


def register(spec: DrafterSpec) -> DrafterSpec:
    """Make a drafter known to the CLI, bench configs, the server and ``make_choice``."""
    if spec.name in DRAFTERS and DRAFTERS[spec.name] is not spec:
        raise VerispecError(f"a drafter named '{spec.name}' is already registered")
    DRAFTERS[spec.name] = spec
    return spec


def lookup(name: str) -> DrafterSpec:
    try:
        return DRAFTERS[name]
    except KeyError:
        raise VerispecError(f"unknown drafter '{name}'; choose from {', '.join(DRAFTERS)}") from None


@dataclasses.dataclass(frozen=True)
class DrafterChoice:
    """A drafter kind with checked parameters and its candidate length: what to build, not built yet
    (a draft model is loaded only when it is built)."""

    name: str
    params: Mapping[str, Any]
    k: int | str  # a positive integer or "auto"

    @property
    def spec(self) -> DrafterSpec:
        return lookup(self.name)

    def build(self, load: ModelLoader | None = None) -> Any:
        if self.spec.model_params and load is None:
            raise VerispecError(f"drafter '{self.name}' needs a model loader")
        return self.spec.build(dict(self.params), self.k, load)

    def describe(self, target: str) -> str:
        return self.spec.describe(dict(self.params), target)

    def as_text(self) -> str:
        """The spec form that parses back to this choice."""
        parts = [f"{key}={'+'.join(map(str, v)) if isinstance(v, list) else v}" for key, v in self.params.items()]
        return f"{self.name}:" + ",".join(parts + [f"k={self.k}"])


def make_choice(name: str, params: Mapping[str, Any] | None = None, k: Any = None,
                where: str | None = None, files: bool = True) -> DrafterChoice:
    """Check ``params`` (text or typed values) for drafter ``name`` and fix K.

    Drafters that need no model are constructed once here, so every check they make (value ranges,
    tuned files) happens before any model is loaded, and K is the one they would use.
    """
    spec = lookup(name)
    where = where or f"drafter '{name}'"
    checked = {}
    for key, value in (params or {}).items():
        if value is None:
            continue
        checked[key] = spec.param(key).parse(value, where, files)
    for p in spec.params:
        if p.required and p.name not in checked:
            raise VerispecError(f"{where}: '{p.name}' is required ({p.help})")
    k_given = None if k is None else parse_k(k, f"{where}: 'k' (candidate length)")
    if spec.model_params:
        return DrafterChoice(name, checked, k_given if k_given is not None else spec.default_k)
    drafter = spec.build(dict(checked), k_given, None)
    return DrafterChoice(name, checked, drafter.k)


def parse_drafter(text: str, files: bool = True) -> DrafterChoice:
    """``NAME`` or ``NAME:key=value,key=value`` (lists as 3+5+7 or, inside one value, 3,5,7).

    ``files=False`` refuses parameters that name settings files."""
    name, _, rest = text.partition(":")
    name = name.strip()
    params: dict[str, str] = {}
    k = None
    for item in re.split(r",(?=\s*[A-Za-z_]\w*\s*=)", rest) if rest.strip() else []:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise VerispecError(f"--drafter {text!r}: expected NAME:key=value,..., got '{item}'")
        if key in params or (key == "k" and k is not None):
            raise VerispecError(f"--drafter {text!r}: '{key}' is given twice")
        if key == "k":
            k = value.strip()
        else:
            params[key] = value.strip()
    return make_choice(name, params, k, where=f"--drafter {name}", files=files)


def flag_selections(flags: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """The drafters CLI flags select, as (name, raw parameters, the flag that selected it).

    A parameter with ``selects`` selects its drafter; other flags only refine it. ``flags`` maps flag
    names ('--layer-skip') to values (None: not given).
    """
    chosen = []
    for spec in DRAFTERS.values():
        given = [p for p in spec.params if p.flag and flags.get(p.flag) is not None]
        selectors = [p for p in given if p.selects]
        if selectors:
            chosen.append((spec.name, {p.name: flags[p.flag] for p in given}, selectors[0].flag))
        elif given:
            need = " or ".join(p.flag for p in spec.params if p.selects)
            raise VerispecError(f"{given[0].flag} refines the {spec.name} drafter: add {need}")
    return chosen


def choices_from_flags(flags: Mapping[str, Any], k: Any = None) -> list[DrafterChoice]:
    """``flag_selections``, checked: one ``DrafterChoice`` per selected drafter."""
    return [make_choice(name, params, k, where=flag) for name, params, flag in flag_selections(flags)]


def cli_flags() -> list[Param]:
    """Every registered parameter that has a CLI flag, for the CLI to offer."""
    return [p for spec in DRAFTERS.values() for p in spec.params if p.flag]


def read_tuned(path: str | Path, method: str) -> dict[str, Any]:
    """A settings file written by ``verispec tune``, checked to be for ``method``."""
    path = Path(path)
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise VerispecError(f"cannot read the {method} settings file {path}: {exc}") from None
    if not isinstance(spec, dict) or spec.get("method") != method:
        found = spec.get("method") if isinstance(spec, dict) else None
        raise VerispecError(f"{path} holds settings for '{found}', not '{method}'")
    return spec
