"""Claim T1: train the architecture family on one budget; writes docs/results/train_compare.{md,json,png}.

A thin wrapper over `cflow train compare` (all flags pass through). The full run used for the
report, about an hour on two cores:

    python benchmarks/train_compare.py --tokens 2000000 --threads 2

A smoke run (seconds per preset): python benchmarks/train_compare.py --tokens 20000 --out /tmp/cmp
"""

from __future__ import annotations

import sys

from cflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", "compare", *sys.argv[1:]]))
