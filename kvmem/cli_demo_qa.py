"""Old import path of :mod:`kvmem.cli.demo_qa`, kept for one release; it goes in the next one.

Import from ``kvmem.cli.demo_qa`` instead.
"""

from kvmem.cli.demo_qa import (
    DEMO_LLAMA,
    LOGIT_TOLERANCE,
    QADemoReport,
    RequestResult,
    Workload,
    build_demo_model,
    describe_model,
    load_local_model,
    make_workload,
    question_summary,
    render_qa_report,
    run_qa_demo,
)

__all__ = [
    "DEMO_LLAMA",
    "LOGIT_TOLERANCE",
    "QADemoReport",
    "RequestResult",
    "Workload",
    "build_demo_model",
    "describe_model",
    "load_local_model",
    "make_workload",
    "question_summary",
    "render_qa_report",
    "run_qa_demo",
]
