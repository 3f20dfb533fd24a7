"""Edges of the Megatron-Bridge dialect found by running Megatron-Bridge's own unit tests
(commit c70daead8) against it: ``GlobalState``'s restart and Megatron-Core-only members,
and the forward-step helpers of ``training.utils.train_utils``."""

from __future__ import annotations

import functools
from typing import Any

import torch

from hookloop.compat.megatron_bridge.training.config import ConfigContainer
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
