"""`cflow bench claims`: every claim of the paper re-measured here, with a verdict, in one report.

    from cflow.bench.claims import run_claims
    results = run_claims("docs/claims", quick=True, only=["C1", "C3"], progress=print)

writes DIR/report.md (one section per claim: the paper's statement and number, what this machine
shows, the commands, each verdict rule fixed in code before the run beside the value it judged, and
the verdict confirmed / refuted / inconclusive with its reason), DIR/report.json
(the data behind it) and PNG plots. One module per claim:

    c1_dag        C1  critical-path bytes of the pipeline-native DAG: the paper's point, a geometry sweep, decode time
    c2_tiles      C2  L1-d read misses and mat-vec time, tiled vs row-major, int8 activations (cachegrind on c2_tiles.c)
    c3_experts    C3  expert bytes per token, top-k vs all (the kernel's read_bytes with experts on disk; engine counters)
    c4_llamacpp   C4  end-to-end decode/prefill against llama.cpp on the same GGUF
    c5_async_io   C5  async vs sync expert I/O at I/O = compute, on learned routing replayed (disk-resident experts)
    c6_prefetch   C6  explicit PREFETCHT0: the shipped default against off, in RAM and disk-bound
    c7_parity     C7  numerical parity: PyTorch reference, HF transformers, llama.cpp
    c8_vflow      C8  cold-cache .cflow vs .vflow
    t1_train      T1  the family table of `cflow train compare` (paired per seed, 95% intervals)

`quick=True` is a smoke test (tiny models, few repetitions; a couple of minutes on 2 cores); the full
run wants an idle machine and an hour or more. A claim whose experiment fails still gets its section
(verdict inconclusive, the error as the reason); the library prints nothing unless given `progress`.
"""

from cflow.bench.claims.runner import CLAIMS, ClaimsError, parse_only, run_claims

__all__ = ["CLAIMS", "ClaimsError", "parse_only", "run_claims"]
