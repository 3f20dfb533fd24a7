"""Edges of the Megatron-Bridge dialect found by running Megatron-Bridge's own unit tests
(commit c70daead8) against it: ``GlobalState``'s restart and Megatron-Core-only members,
and the forward-step helpers of ``training.utils.train_utils``."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hookloop.recipes.gpt as native_gpt
from hookloop.compat.megatron_bridge.recipes import tiny_gpt_pretrain_config
from hookloop.compat.megatron_bridge.training import train as mb_train
from hookloop.compat.megatron_bridge.training.callbacks import CallbackManager
from hookloop.compat.megatron_bridge.training.config import ConfigContainer
from hookloop.compat.megatron_bridge.training.gpt_step import forward_step
from hookloop.compat.megatron_bridge.training.state import GlobalState, TrainState
from hookloop.compat.megatron_bridge.training.utils.train_utils import (
    param_is_not_shared,
    prepare_forward_step_func,
)


def test_reset_for_restart_starts_the_bookkeeping_afresh_and_keeps_the_config(tmp_path):
    cfg = ConfigContainer()
    cfg.logger.tensorboard_dir = str(tmp_path / "tb")
    state = GlobalState()
    state.cfg = cfg
    state.rank_monitor_client = client = object()
    state.fault_tolerance_state.seen_checkpoints_cnt = 3
    started = state.start_time
    state.train_state.step = 7
    with state.timers("forward-backward"):
        pass
    writer = state.tensorboard_logger
    handler = state.signal_handler

    state.reset_for_restart()

    assert state.train_state == TrainState()
    assert "forward-backward" not in state.timers
    assert state.signal_handler is not handler  # a new one, for the same signal
    assert state.signal_handler.sig == handler.sig
    reopened = state.tensorboard_logger
    assert reopened is not None and reopened is not writer
    assert writer.file_writer is None  # the old writer was closed, its events flushed
    assert (state.cfg, state.start_time, state.rank_monitor_client) == (cfg, started, client)
    assert state.fault_tolerance_state.seen_checkpoints_cnt == 3
    state.close_loggers()


def test_megatron_core_only_members_of_global_state_read_as_none():
    cfg = ConfigContainer()
    cfg.checkpoint.save, cfg.checkpoint.async_save = "/unused", True
    state = GlobalState(cfg)
    state.initialize_async_checkpoint_worker()  # the dialect writes in the background itself
    assert state.async_calls_queue is None
    assert state.energy_monitor is None
    assert state.rank_monitor_client is None
    assert state.nvrx_straggler_manager is None


def test_prepare_forward_step_func_binds_the_state_once_for_steps_that_ask():
    state = GlobalState()

    def with_state(state: GlobalState, data_iterator: Any, model: Any) -> int:
        return state.train_state.step

    def without_state(data_iterator: Any, model: Any) -> str:
        return "plain"

    class Counting:  # a functor keeps its own attributes through the binding
        calls = 0

        def __call__(self, global_state: Any, data_iterator: Any, model: Any) -> int:
            self.calls += 1
            return global_state.train_state.step + self.calls

    bound = prepare_forward_step_func(with_state, state)
    assert isinstance(bound, functools.partial) and bound(None, None) == 0
    state.train_state.step = 12
    assert bound(None, None) == 12  # the state itself is bound, not a copy
    assert prepare_forward_step_func(without_state, state) is without_state
    functor = Counting()
    bound_functor = prepare_forward_step_func(functor, state)
    assert [bound_functor(None, None), bound_functor(None, None)] == [13, 14]
    assert functor.calls == 2


def test_param_is_not_shared_reads_megatrons_shared_mark():
    tied = torch.nn.Parameter(torch.zeros(2))
    assert param_is_not_shared(tied) is True
    tied.shared = False
    assert param_is_not_shared(tied) is True
    tied.shared = True
    assert param_is_not_shared(tied) is False


def byte_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    while True:
        x = torch.randint(0, 256, (4, 32), generator=gen)
        yield x, torch.roll(x, -1, dims=1)


def test_the_console_line_shows_each_loss_averaged_over_the_log_interval(caplog):
    cfg = tiny_gpt_pretrain_config(train_iters=4)
    cfg.logger.log_interval = 2
    cfg.train.eval_interval = None
    state = GlobalState(cfg)
    losses: list[float] = []
    manager = CallbackManager()
    manager.register(
        "on_train_step_end", lambda ctx: losses.append(float(ctx.loss_dict["lm loss"]))
    )
    torch.manual_seed(0)
    model = native_gpt.GPT(cfg.gpt_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr)
    with caplog.at_level(logging.INFO, logger="megatron.bridge.training.train"):
        mb_train.train(
            forward_step,
            [model],
            optimizer,
            None,
            byte_batches(),
            None,
            state,
            {},
            callback_manager=manager,
        )
    lines = [r.getMessage() for r in caplog.records if "consumed samples" in r.getMessage()]
    shown = [float(re.search(r"lm loss: (\S+)", line).group(1)) for line in lines]
    assert len(losses) == 4 and losses[0] != losses[1]  # the mean differs from either step
    assert shown == pytest.approx(
        [(losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2], rel=1e-5
    )


def test_a_step_between_console_lines_reads_no_loss_back_to_the_host():
    from hookloop.compat.megatron_bridge.training.loggers import IntervalLosses, log_training_step

    cfg = tiny_gpt_pretrain_config()
    cfg.logger.log_interval = 2
    state = GlobalState(cfg)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    interval = IntervalLosses()
    # A meta tensor has no data: reading it back (float(), .item()) raises.
    unreadable = {"lm loss": torch.ones((), device="meta")}
    with pytest.raises(RuntimeError, match="meta"):
        float(unreadable["lm loss"])
    state.train_state.step = 1  # not a log step: the loss is only added up, on the device
    log_training_step(state, unreadable, None, optimizer, interval)
    assert interval.steps == 1 and interval.sums["lm loss"].device.type == "meta"
