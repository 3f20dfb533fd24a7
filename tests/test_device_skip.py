"""A fused optimizer's non-finite skip is decided on the device: no host read on an
ordinary step, the same weights and logs as the host's verdict, counts settled at the
next boundary (hookloop.loop.device_skip)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hookloop import Config, TrainConfig, Trainer
from hookloop.testing import count_sync_points

NAN_STEPS = (3, 5)  # 1-based optimizer steps whose loss is NaN


def batches(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)) for _ in range(n)]


def model_and_optimizer(fused: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused)


def poisoned_mse(nan_steps: tuple[int, ...]):
    calls = {"n": 0}

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        loss = nn.functional.mse_loss(out, y)
        return loss * math.nan if calls["n"] in nan_steps else loss

    return loss_fn


def train(fused: bool, **train_cfg) -> tuple[nn.Module, object, dict]:
    model, opt = model_and_optimizer(fused)
    train_cfg = {"clip_grad_norm": None, "log_every": 4, **train_cfg}
    cfg = Config(train=TrainConfig(max_steps=8, device="cpu", **train_cfg))
    trainer = Trainer(model, opt, train_data=batches(), loss_fn=poisoned_mse(NAN_STEPS), config=cfg)
    logs: list[dict] = []
    trainer.callbacks.register("on_log", lambda ctx: logs.append(dict(ctx.logs)))
    with count_sync_points() as counts:
        trainer.callbacks.add(counts.marker)
        result = trainer.train()
    steps = {s: (r.ordinary, dict(r.host_reads)) for s, r in counts.steps.items()}
    return model, result, {"logs": logs, "steps": steps}


def test_a_fused_optimizer_skips_on_the_device_with_nothing_read_on_ordinary_steps():
    model, _, seen = train(fused=True)
    ordinary = {s: reads for s, (plain, reads) in seen["steps"].items() if plain}
    assert sorted(ordinary) == [2, 3, 5, 6, 7]  # the NaN steps 3 and 5 among them
    assert all(reads == {} for reads in ordinary.values()), ordinary
    # The log steps read once: the skips are counted in the losses' own transfer.
    assert seen["steps"][4] == seen["steps"][8] == (False, {"tolist": 1})
    # A hand-written loop with the same optimizer that leaves steps 3 and 5 out.
    raw, opt = model_and_optimizer(fused=True)
    for step, (x, y) in enumerate(batches(), start=1):
        if step in NAN_STEPS:
            continue
        nn.functional.mse_loss(raw(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), raw.parameters(), strict=True))
    assert opt.state_dict()["state"][0]["step"].item() == 6  # two updates left out


def test_the_log_and_the_counts_equal_the_host_verdicts():
    _, fused, on_device = train(fused=True)
    _, plain, on_host = train(fused=False)
    assert on_device["logs"] == on_host["logs"]  # skipped losses left out of the means alike
    assert [log["skipped_steps"] for log in on_device["logs"]] == [1, 2]
    assert all(math.isfinite(log["loss"]) for log in on_device["logs"])
    assert fused.logs == plain.logs and fused.stop_reason == plain.stop_reason == "max_steps"
    # The host verdict reads one value on every ordinary step; the device's none.
    host_reads = [r for s, (plain_step, r) in on_host["steps"].items() if plain_step]
    assert all(r.get("item", 0) >= 1 for r in host_reads)


def test_max_skipped_steps_is_checked_when_the_host_next_looks():
    with pytest.raises(
        FloatingPointError, match=r"reaching train.max_skipped_steps=2; the latest by step 8"
    ):
        train(fused=True, log_every=8, max_skipped_steps=2)
    with pytest.raises(FloatingPointError, match=r"train.max_skipped_steps=2; last at step 5"):
        train(fused=False, log_every=8, max_skipped_steps=2)  # the host verdict: at once


def test_an_unfused_optimizer_keeps_the_host_verdict():
    model, opt = model_and_optimizer(fused=False)
    trainer = Trainer(model, opt, train_data=batches(2), loss_fn=poisoned_mse(()),
                      config=Config(train=TrainConfig(max_steps=2, device="cpu")))  # fmt: skip
    trainer.train()
    assert trainer.stepper.device_skip is None


def test_a_resume_follows_the_restored_groups_fused_or_not(tmp_path):
    """A checkpoint of an unfused AdamW resumed by a Trainer given a fused one: the
    restored groups say unfused, so the host verdict steps it (the device's would hand
    an unfused step the scaler's tensors, which torch refuses)."""
    from hookloop.config import CheckpointConfig

    def trainer(fused: bool, steps: int, resume: str | None) -> Trainer:
        model, opt = model_and_optimizer(fused)
        cfg = Config(train=TrainConfig(max_steps=steps, device="cpu", clip_grad_norm=None),
                     checkpoint=CheckpointConfig(every=2))  # fmt: skip
        return Trainer(model, opt, train_data=batches(), loss_fn=nn.functional.mse_loss,
                       config=cfg, out_dir=tmp_path, resume=resume,
                       default_callbacks=False)  # fmt: skip

    trainer(False, 4, None).train()
    resumed = trainer(True, 8, "auto")
    with pytest.warns(UserWarning, match="cannot be positioned mid-epoch"):
        assert resumed.train().step == 8
    assert resumed.optimizer.param_groups[0]["fused"] is False
    assert resumed.stepper.device_skip is None
