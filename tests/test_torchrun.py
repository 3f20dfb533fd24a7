"""`hookloop train` under torchrun as users launch it: two "nodes" with a c10d
rendezvous, and an elastic restart after a worker is killed mid-run."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).with_name("_torchrun_train.py"))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# The tiny recipe, 12 steps of 16 samples per rank, a checkpoint every 4 steps.
TRAIN = ["train", "--recipe", "mlp-regression", "train.max_steps=12", "data.batch_size=16",
         "data.train_samples=512", "train.eval_every=null", "checkpoint.every=4",
         "control.enabled=false", "logging.progress=false",
         "logging.tensorboard=false"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def final_weights(run: Path) -> dict:
    [last] = sorted((run / "checkpoints").glob("step-*"))[-1:]
    assert last.name == "step-00000012"
    return load_file(last / "model.safetensors")


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """Two torchrun agents (one process each) meeting at a c10d rendezvous on 127.0.0.1."""
    out = tmp_path_factory.mktemp("two-nodes") / "run"
    port = free_port()
    nodes = [
        subprocess.Popen(
            [
                *TORCHRUN,
                "--nnodes=2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=hl-two",
                f"--rdzv-conf=is_host={int(node == 0)}",
                SCRIPT,
                *TRAIN,
                "--out",
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environment(),
        )
        for node in (0, 1)
    ]
    done = []
    for node in nodes:
        stdout, stderr = node.communicate(timeout=240)
        done.append(subprocess.CompletedProcess(node.args, node.returncode, stdout, stderr))
    return out, done


def test_two_torchrun_nodes_train_the_recipe_together(two_node_run):
    out, nodes = two_node_run
    for node in nodes:
        assert node.returncode == 0, node.stderr[-4000:]
    output = "".join(n.stdout + n.stderr for n in nodes)
    assert re.search(r"world_size\s+2\n", output)  # one group over both agents
    assert output.count("max_steps at step 12") == 1  # rank 0 reports, on whichever node
    assert [p.name for p in sorted((out / "checkpoints").glob("step-*"))][-1] == "step-00000012"


def test_a_worker_killed_mid_run_is_restarted_by_torchrun_and_ends_on_the_same_weights(
    two_node_run, tmp_path
):
    reference, _ = two_node_run
    out = tmp_path / "run"
    proc = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=3",
         "--monitor-interval=0.2", SCRIPT, *TRAIN, "--out", str(out), "--resume", "auto"],
        capture_output=True, text=True, timeout=240,
        # rank 0 dies after step 6: the rank that holds the run directory's lock and writes
        # the checkpoints (and whose address the next attempt must not read back: #135712)
        env=environment(HOOKLOOP_TEST_KILL_AT="0:6"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    output = proc.stdout + proc.stderr
    assert "failed (exitcode: -9) local_rank: 0" in output  # torchrun saw the worker die
    assert "taking over the lock of" in output  # the dead rank 0's lock, released by the kernel
    assert re.search(r"resumed_at_step\s+4\n", output)  # the restart resumed the step-4 save
    assert "max_steps at step 12" in output
    restored = final_weights(out)
    expected = final_weights(reference)
    assert restored.keys() == expected.keys()
    for name, tensor in expected.items():
        assert restored[name].equal(tensor), name
