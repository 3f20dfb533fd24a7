"""Helpers shared by the GPU tests: a small GPT on CUDA batches, sync and wait probes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import hookloop
from hookloop import Callback, Config, Trainer
from hookloop.optim import build_optimizer
from hookloop.recipes.gpt import GPT, GPTConfig

HOOKLOOP = str(Path(hookloop.__file__).resolve().parent)  # the hookloop these tests run
#: The services a test run does not check: control server, TensorBoard, progress bar.
QUIET = ("control.enabled=false", "logging.tensorboard=false", "logging.progress=false")


def small_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))


def cuda_batches(n: int, batch: int = 8, seq: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (inputs, next-byte targets) batches of random bytes, already on the GPU."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 256, (batch, seq + 1), generator=gen)
        out.append((tokens[:, :-1].cuda(), tokens[:, 1:].cuda()))
    return out


def mean_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_trainer(
    steps: int, callbacks: list[Callback], *, fused: bool = False, **train: Any
) -> Trainer:
    """A small GPT on pre-made CUDA batches: bf16, no logging callbacks, clipping on
    (``fused``: torch's fused AdamW)."""
    cfg = Config()
    if fused:
        cfg.optimizer.kwargs = {"fused": True}
    settings = {
        "max_steps": steps,
        "device": "cuda",
        "precision": "bf16",
        "skip_nonfinite": False,
        "clip_grad_norm": 1.0,
        "log_every": 4,
        "handle_signals": False,
        **train,
    }
    for key, value in settings.items():
        setattr(cfg.train, key, value)
    model = small_gpt()
    return Trainer(
        model,
        build_optimizer(cfg.optimizer, model),
        train_data=cuda_batches(steps),
        loss_fn=mean_ce,
        config=cfg,
        callbacks=callbacks,
    )


class Phase(Callback):
    """Whether the loop is inside a training step (its start..end events) or past it."""

    def __init__(self) -> None:
        self.inside = False

    def on_train_step_start(self, ctx) -> None:
        self.inside = True

    def on_train_step_end(self, ctx) -> None:
        self.inside = False


def where(stack: list[traceback.FrameSummary]) -> str:
    """``file:line function`` of the innermost hookloop frame (else the innermost frame),
    then ``< caller < ...``: the names of the hookloop functions it was called from."""
    ours = [f for f in reversed(stack) if f.filename.startswith(HOOKLOOP)]
    if not ours:
        return f"{Path(stack[-1].filename).name}:{stack[-1].lineno} {stack[-1].name}"
    first = ours[0]
    chain = " < ".join(f.name for f in ours[1:])
    return f"{first.filename[len(HOOKLOOP) + 1 :]}:{first.lineno} {first.name} < {chain}"


@contextlib.contextmanager
def flagged_syncs(trainer: Trainer, phase: Phase) -> Iterator[list[tuple[int, bool, str]]]:
    """``(step, inside a step?, where)`` for every sync ``set_sync_debug_mode`` flags."""
    records: list[tuple[int, bool, str]] = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" in str(message):
            records.append((trainer.state.step, phase.inside, where(traceback.extract_stack())))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield records
        finally:
            torch.cuda.set_sync_debug_mode("default")


def sleep_cycles(ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the GPU busy for about ``ms``."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * ms / start.elapsed_time(end))


class SleepProbe(Callback):
    """Queues a GPU sleep as a step starts and records that step's host time.

    A step that returns long before the sleep could have ended did not wait for the
    GPU; one that took longer waited (a sync, flagged or not). Only the first step after
    each log (``step % every == 1``) is probed: the log's read-back has emptied the GPU's
    queue, so the step's own launches cannot fill it (a full launch queue also blocks the
    host: a step of the default recipe launches ~340 kernels).
    """

    def __init__(self, ms: float, every: int) -> None:
        self.ms, self.every = ms, every
        self.cycles = sleep_cycles(ms)
        self.host_ms: dict[int, float] = {}
        self._began: float | None = None

    def on_train_step_start(self, ctx) -> None:
        if ctx.state.step % self.every == 1 % self.every:
            torch.cuda._sleep(self.cycles)
            self._began = time.perf_counter()

    def on_train_step_end(self, ctx) -> None:
        if self._began is not None:
            self.host_ms[ctx.state.step] = (time.perf_counter() - self._began) * 1e3
            self._began = None

    def waited(self) -> list[int]:
        """The probed steps (but the first, which allocates the optimizer state) that
        waited for the sleep."""
        return [s for s, ms in sorted(self.host_ms.items()) if s > 1 and ms > 0.5 * self.ms]

    def probed(self) -> list[int]:
        return [s for s in sorted(self.host_ms) if s > 1]


def hookloop_train(out: Path, *args: str, timeout: float = 420) -> subprocess.CompletedProcess:
    """``python -m hookloop train --out OUT ARGS`` in a child, this checkout's src first."""
    path = [str(Path(HOOKLOOP).parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "hookloop", "train", "--out", str(out), *QUIET, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc
