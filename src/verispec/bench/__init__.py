"""The evaluation harness: ``verispec bench`` runs experiments, ``verispec report`` renders them.

Names are imported on first use, so reading and rendering results (``records``, ``report``) never
loads torch or the model runtime.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BenchConfig": "config", "Setting": "config", "load_config": "config", "config_from_flags": "config",
    "Prompt": "workloads", "load_workload": "workloads",
    "read_results": "records", "summarise": "records",
    "render_report": "report",
    "run_bench": "runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'verispec.bench' has no attribute '{name}'")
    return getattr(importlib.import_module(f"verispec.bench.{_EXPORTS[name]}"), name)
