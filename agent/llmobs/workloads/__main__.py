"""`python -m llmobs.workloads`: the generation workload (llmobs.workloads.generate)."""

import sys

from llmobs.workloads.generate import main

sys.exit(main())
