"""Entry point of a tensor-parallel worker process: ``python -m trellm.distributed.worker RANK SPEC_JSON``."""
from __future__ import annotations

import json
import sys

from .launch import RankSpec, worker_main

if __name__ == "__main__":
    worker_main(int(sys.argv[1]), RankSpec(**json.loads(sys.argv[2])))
