"""checkpoint.async_save: the loop copies state, a writer thread commits it.

The writer is held back on purpose (its file writes wait until the loop has gone
on training), so each test sees what a slow disk would show: training continuing
during the write, a second save waiting, an exit waiting, a failure surfacing.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import _zygote as zygote
from _quiet import SERVICES_OFF
from hookloop import Config, DataConfig, TrainConfig, Trainer
from hookloop import checkpoint as ckpt
from hookloop.checkpoint import storage
from hookloop.checkpoint.background import HostCopy
from hookloop.entry import seed_everything
from hookloop.testing import TinyModel, ToyData

WRITER = "hookloop-checkpoint-writer"


def trainer(out: Path, *, resume=None, async_save=True, every=3, max_steps=8, **train) -> Trainer:
    cfg = Config(
        train=TrainConfig(
            **{"max_steps": max_steps, "log_every": 0, "handle_signals": False, **train}
        ),
        data=DataConfig(batch_size=4),
        seed=3,
    )
    cfg.checkpoint.every = every
    cfg.checkpoint.keep_last = None
    cfg.checkpoint.async_save = async_save
    seed_everything(cfg.seed)  # each run draws from the same RNG streams
    return Trainer(
        TinyModel(), train_data=ToyData(n=64), loss_fn=TinyModel.loss_fn, config=cfg,
        out_dir=str(out), resume=resume,
    )  # fmt: skip


class HeldWriter:
    """Makes the writer's file writes for checkpoint ``step`` wait until the loop
    reaches ``release_at`` (bounded), and records how many writes overlapped."""

    def __init__(self, monkeypatch, step: int, release_at: int, fail: bool = False) -> None:
        self.name, self.release_at, self.fail = f"step-{step:08d}", release_at, fail
        self.released = threading.Event()
        self.steps_during_write: list[int] = []
        self.active = self.most_active = 0
        self.lock = threading.Lock()
        self.writes: list[str] = []  # every file the writer wrote, in order
        real = storage.write_synced

        def held(path, data):
            self.writes.append(str(path))
            if self.name in str(path):
                with self.lock:
                    self.active += 1
                    self.most_active = max(self.most_active, self.active)
                try:
                    assert self.released.wait(timeout=60), "the loop never reached its release"
                    if self.fail:
                        raise OSError(errno.ENOSPC, "No space left on device")
                    return real(path, data)
                finally:
                    with self.lock:
                        self.active -= 1
            return real(path, data)

        monkeypatch.setattr(storage, "write_synced", held)

    def attach(self, t: Trainer) -> None:
        def step_end(ctx):
            if threading.current_thread() is threading.main_thread():
                if not self.released.is_set() and any(
                    th.name == WRITER for th in threading.enumerate()
                ):
                    self.steps_during_write.append(ctx.state.step)
                if ctx.state.step >= self.release_at:
                    self.released.set()

        t.callbacks.register("on_train_step_end", step_end)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_training_during_a_background_write_does_not_leak_into_the_checkpoint(
    tmp_path, monkeypatch
):
    # Reference: a synchronous run, checkpoints at 3 and 6, ends at 8.
    ref = trainer(tmp_path / "ref", async_save=False)
    ref.train()
    # Async: the writes of checkpoint 3 wait until the loop has trained step 6.
    held = HeldWriter(monkeypatch, step=3, release_at=6)
    run = trainer(tmp_path / "run")
    at_three = {}
    run.callbacks.register(
        "on_train_step_end",
        lambda ctx: at_three.update({k: v.clone() for k, v in ctx.model.state_dict().items()}),
        once=3,
    )
    held.attach(run)
    events = []
    run.callbacks.register(
        "on_checkpoint_save",
        lambda ctx: events.append((ctx.state.step, run.state.step, ctx.checkpoint_timing)),
    )
    run.train()
    assert held.steps_during_write[:3] == [4, 5, 6]  # the loop trained on during the write
    saved = weights(tmp_path / "run" / "checkpoints" / "step-00000003")
    assert saved.keys() == at_three.keys()
    for key, value in at_three.items():
        assert torch.equal(saved[key], value), f"{key} is not the state of step 3"
    # Every checkpoint is bitwise the synchronous run's (model, optimizer, trainer state).
    for step in (3, 6, 8):
        name = f"step-{step:08d}"
        a, b = tmp_path / "ref" / "checkpoints" / name, tmp_path / "run" / "checkpoints" / name
        for key, value in weights(a).items():
            assert torch.equal(weights(b)[key], value), (name, key)
        oa = torch.load(a / "optimizer.pt", weights_only=True)
        ob = torch.load(b / "optimizer.pt", weights_only=True)
        for pid, state in oa["state"].items():
            for key, value in state.items():
                assert torch.equal(ob["state"][pid][key], value), (name, pid, key)
        ta = torch.load(a / "trainer_state.pt", weights_only=True)
        tb = torch.load(b / "trainer_state.pt", weights_only=True)
        assert ta["train_state"] == tb["train_state"] and ta["data"] == tb["data"]
        assert torch.equal(ta["rng"]["torch"], tb["rng"]["torch"])
    # on_checkpoint_save fired after the commit, on a later step, seeing the saved step's state.
    saved_steps = [s for s, _, _ in events]
    assert saved_steps == [3, 6, 8]
    assert events[0][1] >= 6  # fired once the writer was let go, at the loop's step 6 or later
    first = events[0][2]
    assert 0 < first.blocked_seconds < first.seconds
    # Resuming the async checkpoint of step 3 ends bitwise where the synchronous run did.
    again = trainer(
        tmp_path / "run", resume=str(tmp_path / "run" / "checkpoints" / "step-00000003")
    )
    again.train()
    for key, value in ref.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[key], value), key


def test_a_second_save_waits_for_the_first_and_its_wait_counts_as_blocked(tmp_path, monkeypatch):
    held = HeldWriter(monkeypatch, step=1, release_at=2)
    run = trainer(tmp_path, every=1, max_steps=3)
    held.attach(run)
    timings = []
    run.callbacks.register("on_checkpoint_save", lambda ctx: timings.append(ctx.checkpoint_timing))
    run.train()
    assert held.most_active == 1
    # Checkpoint 2 was staged only after checkpoint 1's manifest was written.
    first_of_2 = next(i for i, w in enumerate(held.writes) if "step-00000002" in w)
    manifest_of_1 = next(
        i for i, w in enumerate(held.writes) if "step-00000001" in w and "manifest" in w
    )
    assert manifest_of_1 < first_of_2
    assert [p.name for p in sorted((tmp_path / "checkpoints").glob("step-*"))] == [
        "step-00000001", "step-00000002", "step-00000003",
    ]  # fmt: skip
    assert len(timings) == 3
    # Save 1 was let go during step 2; save 2 then waited at step 2's boundary for it.
    assert timings[0].blocked_seconds <= timings[0].seconds


def test_an_exception_in_training_waits_for_the_write_in_flight(tmp_path, monkeypatch):
    held = HeldWriter(monkeypatch, step=3, release_at=5)
    run = trainer(tmp_path)
    held.attach(run)

    def boom(ctx):
        raise RuntimeError("boom at step 5")

    run.callbacks.register("on_train_step_end", boom, once=5)
    with pytest.raises(RuntimeError, match="boom"):
        run.train()
    assert not [t for t in threading.enumerate() if t.name == WRITER]
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step-00000003"
    ckpt.CheckpointStorage(root).verify(root / "step-00000003")


def test_a_failed_background_save_stops_the_run_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    held = HeldWriter(monkeypatch, step=6, release_at=7, fail=True)
    run = trainer(tmp_path, max_steps=50)
    held.attach(run)
    saved = []
    run.callbacks.register("on_checkpoint_save", lambda ctx: saved.append(ctx.state.step))
    with pytest.raises(
        OSError, match=r"could not write checkpoint step-00000006.*still step-00000003"
    ):
        run.train()
    assert saved == [3]
    assert run.state.step < 12  # stopped at the first boundary after the failure, not at 50
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step-00000003"
    assert not [p for p in root.iterdir() if p.name.startswith(".staging")]


@pytest.mark.slow
def test_hookloop_train_exits_1_naming_the_checkpoint_still_latest_when_a_background_save_fails(
    tmp_path,
):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "hookloop", "train", "--out", str(run),
           "--recipe", "mlp-regression", "train.max_steps=200", "train.log_every=1",
           "checkpoint.every=3", "logging.progress=false", *SERVICES_OFF]  # fmt: skip
    env = {**os.environ, ckpt.FAULT_ENV: "enospc@6"}
    proc = zygote.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hookloop train: error: ") and "Traceback" not in proc.stderr
    assert "could not write checkpoint step-00000006" in last
    assert "the latest checkpoint is still step-00000003, nothing was lost" in last
    assert (run / "checkpoints" / "latest").read_text() == "step-00000003"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert 6 <= max(steps) <= 9  # the save due at 9 waits for 6 and meets its failure


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_every_save_s_time_and_blocked_time_reach_the_next_log(tmp_path, async_save):
    run = trainer(tmp_path, every=1, max_steps=6, log_every=2, async_save=async_save)
    seen, logs = [], []
    run.callbacks.register(
        "on_checkpoint_save", lambda ctx: seen.append((len(logs), ctx.checkpoint_timing))
    )
    run.callbacks.register("on_log", lambda ctx: logs.append(dict(ctx.logs)))
    run.train()
    assert len(seen) == 6  # a save at every step; the last one's after the last log
    for i, record in enumerate(logs):  # each log carries the saves announced since the one before
        mine = [t for n, t in seen if n == i]
        assert record.get("checkpoint/saves", 0) == len(mine)
        if mine:
            assert record["checkpoint/save_seconds"] == pytest.approx(sum(t.seconds for t in mine))
            blocked = record["checkpoint/blocked_seconds"]
            assert blocked == pytest.approx(sum(t.blocked_seconds for t in mine))
            assert 0 < blocked <= record["checkpoint/save_seconds"]
    assert sum(r.get("checkpoint/saves", 0) for r in logs) == len([n for n, _ in seen if n < 3])


def test_tied_weights_are_stored_once_as_a_synchronous_save_stores_them(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(4, 4, bias=False)
            self.out = torch.nn.Linear(4, 4, bias=False)
            self.out.weight = self.inp.weight

        def forward(self, x):
            return self.out(torch.relu(self.inp(x)))

    model = Tied()
    opt = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optimizer": opt, "rng": ckpt.RNGState()}
    frozen = HostCopy()({**state})
    copied = frozen["model"].state_dict()
    assert copied["inp.weight"] is copied["out.weight"]
    sync = ckpt.CheckpointManager(tmp_path / "sync", ckpt.SavePolicy())
    background = ckpt.CheckpointManager(tmp_path / "async", ckpt.SavePolicy())
    a = sync.save(state, step=1, epoch=0)
    b = background.capture(state, step=1, epoch=0, copy=HostCopy()).run()
    assert weights(a).keys() == weights(b).keys() and len(weights(a)) == 1


def test_async_save_must_be_a_bool():
    cfg = Config()
    cfg.checkpoint.async_save = "yes"
    with pytest.raises(ValueError, match=r"checkpoint\.async_save must be true or false"):
        cfg.validate()
