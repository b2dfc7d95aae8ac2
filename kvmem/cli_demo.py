"""Old import path of :mod:`kvmem.cli.demo`, kept for one release; it goes in the next one.

Import from ``kvmem.cli.demo`` instead.
"""

from kvmem.cli.demo import LLAMA_3_2_1B, DemoReport, KVLayout, PhaseResult, cpu_bytes_for, render_report, run_demo

__all__ = ["LLAMA_3_2_1B", "DemoReport", "KVLayout", "PhaseResult", "cpu_bytes_for", "render_report", "run_demo"]
