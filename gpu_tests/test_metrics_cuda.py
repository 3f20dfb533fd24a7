"""DefaultMetrics on CUDA: the peak memory it logs is torch's CUDA peak, tokens per second
agree with samples per second, and the MFU it logs is the FLOPs over the time the GPU
took (not over the time the host took to queue the work)."""

from __future__ import annotations

import time

import pytest
import torch

from hookloop import Callback
from hookloop.callbacks.metrics import DefaultMetrics
from hookloop.entry import build_trainer
from hookloop.recipes import default_config

assert torch.cuda.is_available(), "gpu_tests/ needs a CUDA device"

PEAK_FLOPS = 989e12  # H100 SXM, dense bf16: the figure DefaultMetrics' docstring names


class Logs(Callback):
    priority = 50  # after DefaultMetrics (20)

    def __init__(self) -> None:
        self.logs: list[tuple[int, dict, float]] = []

    def on_log(self, ctx) -> None:
        peak = torch.cuda.max_memory_allocated(ctx.run.device) / 2**20
        self.logs.append((ctx.state.step, dict(ctx.logs), peak))


class SyncedClock(Callback):
    """Wall time at the end of steps ``a`` and ``b``, each after a device synchronize."""

    def __init__(self, a: int, b: int) -> None:
        self.a, self.b, self.at = a, b, {}

    def on_train_step_end(self, ctx) -> None:
        if ctx.state.step in (self.a, self.b):
            torch.cuda.synchronize()
            self.at[ctx.state.step] = time.perf_counter()


def recipe(steps: int, **changes):
    cfg = default_config("gpt-stdlib")
    for key, value in {
        "device": "cuda", "precision": "bf16", "max_steps": steps, "log_every": 10,
        "eval_every": None, "eval_at_epoch_end": False, "handle_signals": False, **changes,
    }.items():  # fmt: skip
        setattr(cfg.train, key, value)
    cfg.checkpoint.every = None
    return cfg


def test_logged_throughput_and_peak_memory_on_cuda():
    cfg = recipe(40)
    logs = Logs()
    trainer = build_trainer(cfg, callbacks=[DefaultMetrics(PEAK_FLOPS), logs])
    trainer.train()
    assert [s for s, _, _ in logs.logs] == [10, 20, 30, 40]
    for _, entry, peak in logs.logs:
        assert entry["peak_mem_mib"] == pytest.approx(peak, rel=1e-9) and peak > 0
        tokens_per_sample = cfg.model.block_size
        assert entry["tok_per_sec"] == pytest.approx(
            entry["samples_per_sec"] * tokens_per_sample, rel=1e-6
        )
        assert 0 < entry["mfu"] < 1


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_logged_mfu_is_flops_over_the_gpus_time(skip_nonfinite):
    """A GPU-bound model (12 layers, width 768): the host queues steps faster than the GPU
    runs them, so time measured on the host alone would overstate MFU."""
    steps, a = 60, 20
    cfg = recipe(steps, skip_nonfinite=skip_nonfinite)
    for key, value in {"n_layer": 12, "n_embd": 768, "n_head": 12, "block_size": 256}.items():
        setattr(cfg.model, key, value)
    logs, clock = Logs(), SyncedClock(a, steps)
    trainer = build_trainer(cfg, callbacks=[DefaultMetrics(PEAK_FLOPS), logs, clock])
    trainer.train()
    flops = trainer.flops_per_sample * cfg.data.batch_size * (steps - a)
    synced = flops / (clock.at[steps] - clock.at[a]) / PEAK_FLOPS
    logged = [e["mfu"] for s, e, _ in logs.logs if s > a]
    ratios = [m / synced for m in logged]
    assert all(0.8 < r < 1.25 for r in ratios), (
        f"logged mfu / synchronised mfu per log: {[round(r, 3) for r in ratios]} "
        f"(synchronised mfu {synced:.4f})"
    )
