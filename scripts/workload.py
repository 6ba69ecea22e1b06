#!/usr/bin/env python3
"""The generation workload by path: the same program as `python -m llmobs.workloads` (see
llmobs/workloads/generate.py and --help), kept so tests, benchmarks and docs can run it as a file."""

import sys

from llmobs.workloads.generate import main

if __name__ == "__main__":
    sys.exit(main())
