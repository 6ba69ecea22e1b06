#!/usr/bin/env python3
"""The training workload by path: the same program as `python -m llmobs.workloads.train` (see
llmobs/workloads/train.py and --help), kept so tests and benchmarks can run it as a file."""

import sys

from llmobs.workloads.train import main

if __name__ == "__main__":
    sys.exit(main())
