"""Benchmarks: llama-bench-style pp/tg throughput, bandwidth context, and baselines side by side.

    from cflow.bench import bench
    report = bench("smollm2.cflow", threads=[1, 2], pp=512, tg=128, reps=5, compare="llama.cpp")
    print(report.to_markdown())

    suite       bench(), the cflow runner and BenchReport (what `cflow bench` prints)
    runner      the pp/tg measurement loop and BenchRow, shared by every engine
    llamacpp    llama.cpp through llama-cpp-python, the baseline
    bandwidth   the machine's read bandwidth, measured by the C core
    disk        the disk's cold read bandwidth (sequential, and random at expert-sized chunks)
    footprint   load time, time to first token and resident memory, in a fresh process
    machine     the machine and build stamp on every result
    perplexity  teacher-forced perplexity through the engine
    profile     per-op time per thread for a decode step and a prefill batch (`cflow bench --profile`),
                as a table and a Chrome trace
    claims      the paper's claims re-measured (`cflow bench claims`)
"""

from cflow.bench.runner import BenchRow
from cflow.bench.suite import BASELINES, BenchReport, CflowRunner, bench

__all__ = ["bench", "BenchReport", "BenchRow", "CflowRunner", "BASELINES"]
