"""Seconds per DiLoCo sync round over loopback: fp32 vs bf16, 1 vs 4 fragments.

A ~10 M-parameter MLP (ten 1024x1024 layers) is one worker of a
``hookloop diloco serve`` started as a separate process on 127.0.0.1 (in the
benchmark's own process the server would share its GIL). A round is one full
period of the worker: with F fragments, F syncs of 1/F of the parameters
each (the pseudo-gradient up, the fragment's new weights down, the server's
averaging and outer Nesterov step in between), until the last answer is in.
No local steps run in between, so the overlap streaming gives a real run is
not credited: this is the communication cost of a round. The four
contenders run interleaved in a fresh random order each round, and the table
shows the median and IQR over rounds of both clocks (see ``_timing.py``):
wall time includes the server's work, CPU time only the worker's (encoding,
copying).

    python bench/diloco.py                 # 15 rounds, ~1 min
    python bench/diloco.py --rounds 2      # the quickest run
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hookloop.diloco import storage
from hookloop.diloco.client import DiLoCoClient, ServerUnavailable
from hookloop.diloco.worker import DiLoCoWorker

TOKEN = "bench-token-0123456789abcdef"
CASES = [(bf16, frags) for frags in (1, 4) for bf16 in (False, True)]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(10)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, start: Path, out: Path) -> subprocess.Popen:
    """``hookloop diloco serve`` for one worker, from the checkpoint ``start``, never saving."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hookloop", "diloco", "serve", "-o", str(out), "-n", "1",
         "--from-checkpoint", str(start), "--port", str(port), "--token", TOKEN,
         "--save-every", "0", "--no-dashboard"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            DiLoCoClient(f"127.0.0.1:{port}", token=TOKEN, timeout=2).status()
            return proc
        except ServerUnavailable:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the DiLoCo server did not start within 120 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds (>= 2; default 15)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error(f"--rounds must be >= 2 (a spread needs two), got {args.rounds}")
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    net = model()
    n_params = sum(p.numel() for p in net.parameters())
    # One server per contender: a round waits for every live worker of its server.
    servers, workers = [], {}
    scratch = tempfile.TemporaryDirectory(prefix="hookloop-bench-diloco-")
    start = storage.save_initial(Path(scratch.name) / "start", net)
    try:
        for bf16, frags in CASES:
            port = free_port()
            servers.append(start_server(port, start, Path(scratch.name) / f"out-{port}"))
            w = DiLoCoWorker(
                net, server_addr=f"127.0.0.1:{port}", sync_every=frags,
                worker_id=f"bench-{frags}-{int(bf16)}", bf16_comm=bf16, dylu=False,
                heartbeat_interval=0, num_fragments=frags, timeout=120,
                max_sync_retries=0, token=TOKEN,
            )  # fmt: skip
            w.start()
            workers[(bf16, frags)] = w
        wall: dict[tuple[bool, int], list[float]] = {c: [] for c in CASES}
        cpu: dict[tuple[bool, int], list[float]] = {c: [] for c in CASES}
        sent: dict[tuple[bool, int], int] = {}
        for _ in range(args.rounds):
            for case in rng.sample(CASES, len(CASES)):
                w = workers[case]
                before = w.client.bytes_sent
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(case[1]):  # one period: every fragment once
                    w.after_step()
                w.finish_in_flight()  # streaming leaves the last fragment in flight: count it
                wall[case].append(time.perf_counter() - t0)
                cpu[case].append(time.process_time() - c0)
                sent[case] = w.client.bytes_sent - before
        for w in workers.values():
            w.stop()
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(timeout=10)
        scratch.cleanup()
    print(f"{n_params / 1e6:.1f} M parameters, {args.rounds} rounds, torch {torch.__version__}")
    print(f"{'comm':<6}{'fragments':>10}{'MB sent':>10}{'wall s':>10}{'IQR':>16}{'cpu s':>9}")
    for case in CASES:
        q = statistics.quantiles(wall[case], n=4)
        print(
            f"{'bf16' if case[0] else 'fp32':<6}{case[1]:>10}{sent[case] / 1e6:>10.1f}"
            f"{statistics.median(wall[case]):>10.3f}{f'{q[0]:.3f}-{q[2]:.3f}':>16}"
            f"{statistics.median(cpu[case]):>9.3f}"
        )


if __name__ == "__main__":
    main()
