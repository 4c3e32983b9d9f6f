"""torchrun entry point for tests/test_distributed.py: ``python -m classify.train`` with a crash injected.

``CLASSIFY_TEST_CRASH="RANKS:STEP"`` (e.g. ``1:3`` or ``0,1:13``) makes optimizer step STEP raise on
the listed ranks, as an out-of-memory error or a kill would end them; files are left as they were.
"""

import os
import sys

import classify.engine.loop as loop
import classify.train as train_module
from classify.errors import run_cli


def inject_crash(spec: str) -> None:
    ranks, step = spec.split(":")
    if os.environ["RANK"] not in ranks.split(","):
        return
    real_step, calls = loop.optimizer_step, {"n": 0}

    def crashing_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == int(step):
            raise RuntimeError(f"simulated crash on rank {os.environ['RANK']}")
        return real_step(*args, **kwargs)

    loop.optimizer_step = crashing_step


if __name__ == "__main__":
    if os.environ.get("CLASSIFY_TEST_CRASH"):
        inject_crash(os.environ["CLASSIFY_TEST_CRASH"])
    sys.exit(run_cli(train_module.main, prog="classify.train"))
