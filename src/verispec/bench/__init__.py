"""The evaluation harness: ``verispec bench`` runs experiments, ``verispec report`` renders them."""

from verispec.bench.config import BenchConfig, Setting, load_config
from verispec.bench.report import render_report
from verispec.bench.runner import read_results, run_bench, summarise
from verispec.bench.workloads import Prompt, load_workload

__all__ = ["BenchConfig", "Prompt", "Setting", "load_config", "load_workload", "read_results", "render_report",
           "run_bench", "summarise"]
