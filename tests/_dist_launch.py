"""Launch ``tests/_dist_job.py`` on 1 or N ranks and read back each rank's result (one rank:
forked from a zygote that has imported torch already, tests/_zygote.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import _zygote as zygote

JOB = str(Path(__file__).with_name("_dist_job.py"))


def torchrun(ranks: int) -> list[str]:
    """The command prefix that starts ``ranks`` processes (plain python for one)."""
    if ranks == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={ranks}"]  # fmt: skip


def run_job(mode: str, out: Path, *overrides: str, ranks: int = 2) -> list[dict]:
    """Run the job in ``mode``; returns the result record of every rank, in rank order."""
    cmd = [*torchrun(ranks), JOB, mode, str(out), *overrides]
    start = zygote.run if ranks == 1 else subprocess.run  # torchrun starts its own ranks
    proc = start(cmd, capture_output=True, text=True, timeout=240)
    # The tail holds torchrun's summary and, before it, a dead rank's own last words.
    assert proc.returncode == 0, proc.stderr[-8000:]
    return [json.loads((out / f"result-{mode}-rank{r}.json").read_text()) for r in range(ranks)]
