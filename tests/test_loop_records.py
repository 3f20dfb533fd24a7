"""The parts of the loop are built from small records, and the record of all of them is
made only once each part is built (:mod:`hookloop.loop.records`, :mod:`hookloop.loop.parts`)."""

from __future__ import annotations

import dataclasses
import time

import torch

from hookloop.checkpoint.rewind import Rewinder
from hookloop.config import Config, TrainConfig
from hookloop.loop import Trainer
from hookloop.loop.records import Compute, Events, LoopTiming, Trained
from hookloop.loop.stepper import Clipping, MicroStep, Stepper, UpdateRules
from hookloop.manager import CallbackManager
from hookloop.precision import Precision
from hookloop.state import CallbackContext, Progress, TrainState
from hookloop.step import bind_forward_step, default_forward_step
from hookloop.testing import TinyModel
from hookloop.timers import NULL_TIMER

STEPS = 4


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        x = torch.randn(8, 4, generator=g)
        batches.append((x, x.sum(dim=1, keepdim=True) / 2))
    return batches


def _config() -> TrainConfig:
    return TrainConfig(max_steps=STEPS, log_every=0, clip_grad_norm=0.5, device="cpu")


def test_a_stepper_built_from_the_records_alone_steps_as_the_trainer_does():
    """What Megatron-Bridge's dialect does: a Stepper outside the Trainer, given only the
    records it names, updates the weights bit for bit as the Trainer's own Stepper."""
    model = TinyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(
        model, optimizer, train_data=_batches(), config=_config(), loss_fn=TinyModel.loss_fn
    )
    trainer.train()

    alone = TinyModel()
    sgd = torch.optim.SGD(alone.parameters(), lr=0.1)
    progress = Progress()
    device = torch.device("cpu")
    precision = Precision("fp32", device)
    forward = bind_forward_step(default_forward_step(TinyModel.loss_fn, device))
    compute = Compute(forward, TrainState(progress), precision, device)
    manager = CallbackManager()
    stepper = Stepper(
        trained=Trained(alone, alone, sgd),
        compute=compute,
        micro_step=MicroStep(forward, compute.state, precision),
        rules=UpdateRules(Clipping(0.5), _config()),
        events=Events(CallbackContext(), manager.index, manager.fire),
        progress=progress,
        rewinder=Rewinder(progress, 1),
        timing=LoopTiming(
            time.perf_counter, dict.fromkeys(("forward-backward", "optimizer"), NULL_TIMER)
        ),
    )
    for batch in _batches():
        progress.step += 1
        stepper.forward_backward([batch])
        losses, norm = stepper.prepare()
        assert norm is not None  # clipping to 0.5 measures the norm
        assert not stepper.update(losses, norm)

    for ours, theirs in zip(alone.parameters(), trainer.model.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    assert stepper.clipping.max_norm == trainer.stepper.clipping.max_norm == 0.5


def test_every_part_is_built_before_the_record_of_them_is(tmp_path):
    trainer = Trainer(
        TinyModel(),
        train_data=_batches(),
        config=Config(train=_config()),
        loss_fn=TinyModel.loss_fn,
        out_dir=tmp_path,
    )
    parts = trainer.parts
    unset = [f.name for f in dataclasses.fields(parts) if getattr(parts, f.name) is None]
    assert unset == ["resume"]  # what the run was not given, and nothing else
    # The live settings the checkpoint saves are the run's, and change its Stepper's clipping.
    assert trainer.ctx.settings is parts.live
    parts.live.apply({"a": {"values": {"clip_grad_norm": 0.25}, "client": "test"}})
    assert trainer.stepper.clipping.max_norm == 0.25


def test_a_checkpoint_names_its_states_as_it_always_has(tmp_path):
    """The names are the file format (tests/data/checkpoint_v0 resumes with them)."""
    trainer = Trainer(
        TinyModel(),
        train_data=_batches(),
        config=Config(train=_config()),
        loss_fn=TinyModel.loss_fn,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2),
        out_dir=tmp_path,
    )
    names = list(trainer.checkpointer.named_state())
    assert names == [
        "model",
        "optimizer",
        "scheduler",
        "train_state",
        "scaler",
        "user_state",
        "callbacks",
        "data",
        "log_pending",
        "rewind",
        "settings",
        "rng",
    ]
    state = trainer.checkpointer.named_state()
    assert state["model"] is trainer.model and state["optimizer"] is trainer.optimizer
    assert state["settings"] is trainer.parts.live and state["train_state"] is trainer.state
