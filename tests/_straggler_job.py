"""Two ranks, one slowed on purpose, with straggler detection and a control server (torchrun)."""

from __future__ import annotations

import http.client
import json
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from hookloop.callbacks.straggler import StragglerDetection
from hookloop.config import apply_overrides
from hookloop.control import ControlServer
from hookloop.distributed import init_from_env, leave_process_group, rank_info
from hookloop.entry import build_trainer
from hookloop.recipes import default_config

SLOW_RANK, SLEEP_S = 1, 0.2


def fetch_status(server: ControlServer) -> dict:
    """GET this job's status from its own server (rank 0), as a client would."""
    url = urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.request("GET", f"/jobs/{server.job_id}/status",
                     headers={"Authorization": f"Bearer {server.token}"})  # fmt: skip
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def main() -> None:
    out = Path(sys.argv[1])
    init_from_env()
    rank, _, world = rank_info()
    cfg = default_config("mlp-regression")
    apply_overrides(cfg, ["train.max_steps=8", "data.batch_size=16", "train.log_every=0",
                          "data.train_samples=256", "train.eval_every=null"])  # fmt: skip
    trainer = build_trainer(cfg)
    detector = StragglerDetection(every=4)
    server = ControlServer(jobs_dir=out / "jobs", announce=False, required=True)
    trainer.callbacks.add([detector, server])
    if rank == SLOW_RANK:  # this rank's own work takes SLEEP_S longer every step
        trainer.callbacks.register("on_train_step_start", lambda ctx: time.sleep(SLEEP_S))
    statuses: list[dict] = []
    if rank == 0:
        trainer.callbacks.register(
            "on_train_step_end", lambda ctx: statuses.append(fetch_status(server)), every=4,
            priority=90,  # after the detector (2) published its report for this step
        )  # fmt: skip
    trainer.train()
    record = {"rank": rank, "report": detector.report, "statuses": statuses}
    (out / f"straggler-rank{rank}.json").write_text(json.dumps(record))
    if world > 1:
        leave_process_group()


if __name__ == "__main__":
    main()
