"""Megatron-Bridge's ``training.train`` on plain torch objects: the loop, a step, the exits,
the checkpoint and progress-log helpers, and the functions only Megatron-Core needs."""

from __future__ import annotations

import gc
import inspect
import os
import re
import signal
import sys
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

import hookloop.recipes.gpt as native_gpt
from hookloop.callbacks.progress_log import first_job_start
from hookloop.checkpoint import load_weights
from hookloop.compat.megatron_bridge.recipes import tiny_gpt_pretrain_config
from hookloop.compat.megatron_bridge.training import train as mb_train
from hookloop.compat.megatron_bridge.training.callbacks import CallbackManager
from hookloop.compat.megatron_bridge.training.config import ConfigContainer
from hookloop.compat.megatron_bridge.training.gpt_step import forward_step
from hookloop.compat.megatron_bridge.training.pretrain import pretrain
from hookloop.compat.megatron_bridge.training.state import GlobalState

#: The 14 functions of Megatron-Bridge's ``training.train`` and their parameters, as the
#: design documents list them.
DOCUMENTED = {
    "train": [
        "forward_step_func",
        "model",
        "optimizer",
        "scheduler",
        "train_data_iterator",
        "valid_data_iterator",
        "global_state",
        "checkpointing_context",
        "process_non_loss_data_func",
        "non_loss_data_func",
    ],
    "train_step": [
        "forward_step_func",
        "data_iterator",
        "model",
        "optimizer",
        "scheduler",
        "global_state",
    ],
    "post_training_step_callbacks": [
        "model",
        "num_floating_point_operations_since_last_log_event",
        "straggler_timer",
        "iteration",
        "prof",
        "config",
        "should_toggle_forward_pre_hook",
        "nsys_nvtx_context",
    ],
    "should_disable_forward_pre_hook": [
        "use_megatron_fsdp",
        "use_distributed_optimizer",
        "overlap_param_gather",
    ],
    "enable_forward_pre_hook": ["model"],
    "disable_forward_pre_hook": ["model", "param_sync"],
    "get_start_time_from_progress_log": ["cfg"],
    "compute_throughputs_and_append_to_progress_log": [
        "state",
        "num_floating_point_operations_so_far",
    ],
    "save_checkpoint_and_time": [
        "state",
        "model",
        "optimizer",
        "opt_param_scheduler",
        "num_floating_point_operations_so_far",
        "checkpointing_context",
        "non_persistent_ckpt",
        "train_data_iterator",
    ],
    "checkpoint_and_decide_exit": [
        "state",
        "model",
        "optimizer",
        "opt_param_scheduler",
        "num_floating_point_operations_so_far",
        "checkpointing_context",
        "train_data_iterator",
    ],
    "_finish_train": ["global_state"],
    "_should_skip_and_handle_iteration": ["global_state", "train_data_iterator"],
    "_dummy_train_step": ["global_state", "train_data_iterator"],
    "_handle_mxfp8_param_buffer_copy": [
        "optimizer",
        "reuse_grad_buf_for_mxfp8_param_ag",
        "overlap_param_gather",
    ],
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_each_documented_function_takes_the_documented_positional_parameters(name):
    params = inspect.signature(getattr(mb_train, name)).parameters.values()
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == DOCUMENTED[name]


# -- a small run of the loop


def byte_batches(seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets) micro-batches of 4 random 32-byte windows."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, 256, (4, 32), generator=gen)
        yield x, torch.roll(x, -1, dims=1)


class Counting:
    """An iterator that counts the micro-batches drawn from it."""

    def __init__(self, inner: Iterator[Any]) -> None:
        self.inner, self.drawn = inner, 0

    def __iter__(self) -> Counting:
        return self

    def __next__(self) -> Any:
        self.drawn += 1
        return next(self.inner)


def setup_run(cfg: ConfigContainer) -> dict[str, Any]:
    """Model, optimizer, scheduler and state for ``train()``, as user code builds them."""
    torch.manual_seed(0)
    model = native_gpt.GPT(cfg.gpt_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr)
    return {
        "model": [model],
        "optimizer": optimizer,
        "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
        "global_state": GlobalState(cfg),
    }


def recorder(events: list[tuple[Any, ...]]) -> CallbackManager:
    manager = CallbackManager()
    for event in (
        "on_train_start",
        "on_train_step_start",
        "on_train_step_end",
        "on_eval_start",
        "on_eval_end",
        "on_checkpoint_save",
        "on_train_end",
    ):
        manager.register(event, lambda ctx, e=event: events.append((e, ctx.state.train_state.step)))
    return manager


def run_train(cfg: ConfigContainer, events: list[Any], **kw: Any) -> dict[str, Any]:
    run = setup_run(cfg)
    train_data = Counting(byte_batches(1))
    mb_train.train(
        forward_step,
        run["model"],
        run["optimizer"],
        run["scheduler"],
        train_data,
        byte_batches(2),
        run["global_state"],
        {},
        callback_manager=recorder(events),
        **kw,
    )
    return run | {"train_data": train_data}


def train_without_validation(
    run: dict[str, Any], manager: CallbackManager, scheduler: Any = "given"
) -> None:
    """``train()`` over ``run``'s objects (its scheduler, unless another is given) on a
    training stream, with no validation iterator."""
    mb_train.train(
        forward_step,
        run["model"],
        run["optimizer"],
        run["scheduler"] if scheduler == "given" else scheduler,
        byte_batches(1),
        None,
        run["global_state"],
        {},
        callback_manager=manager,
    )


def test_train_runs_megatron_bridges_loop_with_its_events_counters_and_saves(tmp_path):
    cfg = tiny_gpt_pretrain_config(train_iters=4, save=str(tmp_path), save_interval=2)
    events: list[Any] = []
    run = run_train(cfg, events)
    assert events == [
        ("on_train_start", 0),
        ("on_train_step_start", 0),
        ("on_train_step_end", 0),
        ("on_train_step_start", 1),
        ("on_train_step_end", 1),
        ("on_eval_start", 2),
        ("on_eval_end", 2),
        ("on_checkpoint_save", 2),
        ("on_train_step_start", 2),
        ("on_train_step_end", 2),
        ("on_train_step_start", 3),
        ("on_train_step_end", 3),
        ("on_eval_start", 4),
        ("on_eval_end", 4),
        ("on_checkpoint_save", 4),
        ("on_train_end", 4),
    ]
    ts = run["global_state"].train_state
    assert (ts.step, ts.consumed_train_samples, ts.skipped_train_samples) == (4, 32, 0)
    # two validations of eval_iters=2 global batches of 8 samples
    assert ts.consumed_valid_samples == 2 * 2 * 8
    assert ts.floating_point_operations_so_far > 0 and ts.do_train and ts.do_valid
    assert run["train_data"].drawn == 4 * 2  # two micro-batches a step
    assert run["optimizer"].param_groups[0]["lr"] == pytest.approx(cfg.optimizer.lr / 16)
    saved = native_gpt.GPT(cfg.gpt_config())
    load_weights(saved, tmp_path / "checkpoints" / "step-00000004")
    for mine, theirs in zip(saved.parameters(), run["model"][0].parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_listed_iteration_reads_its_data_and_counts_its_samples_as_skipped():
    cfg = tiny_gpt_pretrain_config(train_iters=3, eval_interval=None)
    cfg.train.iterations_to_skip = [1]
    events: list[Any] = []
    run = run_train(cfg, events)
    steps = [step for event, step in events if event == "on_train_step_start"]
    assert steps == [0, 2]
    ts = run["global_state"].train_state
    assert (ts.step, ts.consumed_train_samples, ts.skipped_train_samples) == (3, 24, 8)
    assert run["train_data"].drawn == 3 * 2


def test_exit_interval_saves_and_exits_the_process_without_on_train_end(tmp_path):
    cfg = tiny_gpt_pretrain_config(train_iters=6, eval_interval=None, save=str(tmp_path))
    cfg.train.exit_interval = 2
    cfg.logger.log_progress = True
    events: list[Any] = []
    with pytest.raises(SystemExit) as exit_info:
        run_train(cfg, events)
    assert exit_info.value.code == 0
    assert events[-1] == ("on_checkpoint_save", 2)
    assert "on_train_end" not in [event for event, _ in events]
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    assert [line.split("\t")[3] for line in lines] == ["Starting job", "Saved checkpoint"]
    assert re.fullmatch(
        r"\S+ \S+\tJob ID: \S*\t# GPUs: 1\tSaved checkpoint\tIteration: 2\t"
        r"Job throughput: \d+\.\d MODEL_TFLOP/s/GPU\t"
        r"Cumulative throughput: \d+\.\d MODEL_TFLOP/s/GPU\t"
        r"Floating-point operations: \d\.\d\de\+\d\d\t"
        r"Tokens \(in billions\): 0\.00",
        lines[1],
    )
    assert first_job_start(tmp_path / "progress.txt", 1) is not None


def test_a_skipped_iteration_adds_no_floating_point_operations():
    states = {}
    for skip in ([], [1]):
        cfg = tiny_gpt_pretrain_config(train_iters=3, eval_interval=None)
        cfg.train.iterations_to_skip = skip
        states[len(skip)] = run_train(cfg, [])["global_state"].train_state
    trained, skipped = states[0], states[1]
    assert skipped.floating_point_operations_so_far == pytest.approx(
        trained.floating_point_operations_so_far * 2 / 3
    )


def test_train_catches_the_configured_exit_signal_and_leaves_sigterm_alone(tmp_path):
    cfg = tiny_gpt_pretrain_config(train_iters=6, eval_interval=None, save=str(tmp_path))
    cfg.train.exit_signal_handler = True
    cfg.train.exit_signal = int(signal.SIGUSR1)
    sigterm_before = signal.getsignal(signal.SIGTERM)
    seen: list[Any] = []
    manager = recorder(seen)

    def signal_at_step_one(ctx: Any) -> None:
        if ctx.state.train_state.step == 1:
            seen.append(("SIGTERM handler", signal.getsignal(signal.SIGTERM) is sigterm_before))
            os.kill(os.getpid(), signal.SIGUSR1)  # as a job scheduler warning the job

    manager.register("on_train_step_end", signal_at_step_one)
    run = setup_run(cfg)
    with pytest.raises(SystemExit) as info:
        train_without_validation(run, manager)
    assert info.value.code == 0
    assert ("SIGTERM handler", True) in seen  # only the configured signal is taken over
    assert seen[-1] == ("on_checkpoint_save", 2) and ("on_train_end", 2) not in seen
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-00000002"]


def test_the_time_limit_counts_from_the_global_states_start_time(tmp_path):
    cfg = tiny_gpt_pretrain_config(train_iters=6, eval_interval=None, save=str(tmp_path))
    cfg.train.exit_duration_in_mins = 1.0
    run = setup_run(cfg)
    run["global_state"].start_time -= 120.0  # the job started two minutes ago
    events: list[Any] = []
    with pytest.raises(SystemExit):
        train_without_validation(run, recorder(events))
    assert run["global_state"].train_state.step == 1  # the first step ends past the limit
    assert events[-1] == ("on_checkpoint_save", 1)


def test_native_requests_reach_train_a_save_a_live_learning_rate_and_a_stop(tmp_path):
    """``training.train`` runs hookloop's loop: a native callback's requests are agreed and
    carried out there (a save, a live ``set``, a stop, which ends training normally)."""
    cfg = tiny_gpt_pretrain_config(train_iters=6, eval_interval=None, save=str(tmp_path))
    events: list[Any] = []
    manager = recorder(events)

    def ask(ctx: Any) -> None:
        step = ctx.state.step
        if step == 1:
            ctx.control.request_save()
        elif step == 2:
            ctx.control.request("set", **{"0" * 20: {"values": {"lr": 0.125}, "client": "t"}})
        elif step == 3:
            ctx.control.request_stop("enough")

    manager.native.register("on_train_step_end", ask)
    run = setup_run(cfg)
    train_without_validation(run, manager, None)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == [
        "step-00000001",
        "step-00000003",  # a stop saves, as the loop does
    ]
    assert run["optimizer"].param_groups[0]["lr"] == 0.125
    assert events[-1] == ("on_train_end", 3)
    assert run["global_state"].train_state.step == 3


def test_train_step_returns_megatron_bridges_seven_values_and_updates_the_model():
    cfg = tiny_gpt_pretrain_config()
    run = setup_run(cfg)
    before = [p.detach().clone() for p in run["model"][0].parameters()]
    loss_dict, skipped, should_checkpoint, should_exit, code, grad_norm, zeros = (
        mb_train.train_step(
            forward_step,
            byte_batches(),
            run["model"],
            run["optimizer"],
            run["scheduler"],
            run["global_state"],
        )
    )
    assert list(loss_dict) == ["lm loss"] and loss_dict["lm loss"].dim() == 0
    assert (skipped, should_checkpoint, should_exit, code, zeros) == (0, False, False, 0, None)
    assert isinstance(grad_norm, float) and grad_norm > 0
    assert any(
        not torch.equal(a, b) for a, b in zip(before, run["model"][0].parameters(), strict=True)
    )
    cfg.optimizer.clip_grad = 0.0
    assert mb_train.train_step(forward_step, byte_batches(), **_step_kwargs(run))[5] is None


def linear_step(
    samples: list[torch.Tensor], scale: float = 1.0
) -> tuple[Any, Iterator[torch.Tensor]]:
    """A forward step with the ``(loss, num_tokens, loss_dict)`` pattern over ``samples``
    (one micro-batch each), its loss multiplied by ``scale``."""

    def step(data_iterator: Iterator[torch.Tensor], model: torch.nn.Module) -> Any:
        x = next(data_iterator)
        out = model(x)

        def loss_func(output: torch.Tensor) -> Any:
            total = (output**2).sum() * scale
            tokens = torch.tensor(float(output.numel()))
            return total, tokens, {"lm loss": torch.stack([total.detach(), tokens])}

        return out, loss_func

    return step, iter(samples)


def test_train_step_backpropagates_megatrons_scaled_losses_and_clips_once():
    cfg = tiny_gpt_pretrain_config()  # two micro-batches a step, clip_grad 1.0
    cfg.optimizer.clip_grad = 0.5
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    reference = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    samples = [torch.randn(4, 3), torch.randn(2, 3)]
    step, data = linear_step(samples)
    loss_dict, skipped, _, _, _, grad_norm, _ = mb_train.train_step(
        step, data, [model], optimizer, scheduler, GlobalState(cfg)
    )
    # By hand: each micro-batch's loss over its tokens over the micro-batch count, summed
    # gradients, clipped to 0.5, one SGD update.
    weight, bias = (t.clone().requires_grad_() for t in reference)
    total = sum(
        ((x @ weight.T + bias) ** 2).sum() / (x.shape[0] * 2) / len(samples) for x in samples
    )
    total.backward()
    norm = torch.cat([weight.grad.flatten(), bias.grad.flatten()]).norm()
    factor = min(1.0, 0.5 / (float(norm) + 1e-6))
    assert grad_norm == pytest.approx(float(norm), rel=1e-5)
    for param, ref in zip(model.parameters(), (weight, bias), strict=True):
        expected = ref.detach() - 0.1 * factor * ref.grad
        assert torch.allclose(param.detach(), expected, atol=1e-6)
        assert param.grad is None  # cleared after the update
    sums = [((x @ reference[0].T + reference[1]) ** 2).sum() for x in samples]
    assert loss_dict["lm loss"].item() == pytest.approx(float(sum(sums)) / 12, rel=1e-5)
    assert skipped == 0 and optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_a_non_finite_gradient_norm_skips_the_update_and_the_scheduler_step():
    cfg = tiny_gpt_pretrain_config()
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    step, data = linear_step([torch.randn(4, 3), torch.randn(4, 3)], scale=float("inf"))
    _, skipped, _, _, _, grad_norm, _ = mb_train.train_step(
        step, data, [model], optimizer, scheduler, GlobalState(cfg)
    )
    assert (skipped, grad_norm) == (1, None)
    assert optimizer.param_groups[0]["lr"] == 0.1  # the scheduler did not step
    for param, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(param.detach(), old) and param.grad is None


class IncrementScheduler:
    """A scheduler stepped as Megatron's ``OptimizerParamScheduler`` is: by samples."""

    def __init__(self) -> None:
        self.increments: list[int] = []

    def step(self, increment: int) -> None:
        self.increments.append(increment)


def test_a_megatron_style_scheduler_steps_by_the_global_batch_after_each_update():
    cfg = tiny_gpt_pretrain_config()
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = IncrementScheduler()
    state = GlobalState(cfg)
    step, data = linear_step([torch.randn(4, 3) for _ in range(2)])
    mb_train.train_step(step, data, [model], optimizer, scheduler, state)
    assert scheduler.increments == [cfg.train.global_batch_size]
    step, data = linear_step([torch.randn(4, 3) for _ in range(2)], scale=float("inf"))
    assert mb_train.train_step(step, data, [model], optimizer, scheduler, state)[1] == 1
    assert scheduler.increments == [cfg.train.global_batch_size]  # not after a skipped update


def test_train_steps_a_megatron_style_scheduler_and_callbacks_see_it_as_given(tmp_path):
    cfg = tiny_gpt_pretrain_config(train_iters=3, eval_interval=None, save=str(tmp_path))
    cfg.checkpoint.save_interval = 3  # a checkpoint holds the scheduler too
    run = setup_run(cfg)
    scheduler = IncrementScheduler()
    seen: list[Any] = []
    manager = CallbackManager()
    manager.register("on_train_step_end", lambda ctx: seen.append(ctx.scheduler))
    train_without_validation(run, manager, scheduler)
    assert scheduler.increments == [cfg.train.global_batch_size] * 3
    assert seen == [scheduler] * 3
    assert (tmp_path / "checkpoints" / "step-00000003").is_dir()


def _step_kwargs(run: dict[str, Any]) -> dict[str, Any]:
    keys = ("model", "optimizer", "scheduler", "global_state")
    return {key: run[key] for key in keys}


def test_a_data_iterator_that_runs_dry_is_named():
    cfg = tiny_gpt_pretrain_config()
    run = setup_run(cfg)
    with pytest.raises(RuntimeError, match=r"train_data_iterator ran out of data at micro-batch 2"):
        mb_train.train_step(forward_step, iter([next(byte_batches())]), **_step_kwargs(run))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": torch.nn.Linear(2, 2)}, r"model must be a non-empty list of model chunks"),
        ({"model": [torch.nn.Linear(2, 2)] * 2}, r"model has 2 chunks.*need Megatron-Core"),
        ({"optimizer": "adam"}, r"optimizer must be a torch optimizer, got str"),
        ({"global_state": GlobalState()}, r"global_state.cfg must be a ConfigContainer"),
        ({"checkpointing_context": None}, r"checkpointing_context must be a dict"),
        ({"forward_step_func": 3}, r"forward_step_func must be callable"),
    ],
)
def test_train_names_the_argument_it_cannot_drive(change, message):
    run = setup_run(tiny_gpt_pretrain_config())
    args = {
        "forward_step_func": forward_step,
        **run,
        "train_data_iterator": byte_batches(),
        "valid_data_iterator": None,
        "checkpointing_context": {},
    } | change
    with pytest.raises((TypeError, ValueError), match=message):
        mb_train.train(**args)


def test_pretrain_refuses_iterations_to_skip_and_says_where_it_applies():
    cfg = tiny_gpt_pretrain_config()
    cfg.train.iterations_to_skip = [1]
    with pytest.raises(ValueError, match=r"iterations_to_skip is honoured by training.train"):
        pretrain(cfg, forward_step)
    cfg.train.iterations_to_skip = [-1]
    with pytest.raises(ValueError, match=r"iterations_to_skip must be a list of step numbers"):
        cfg.validate()


# -- the progress-log helpers


def test_throughput_lines_need_a_starting_job_line_of_this_world_size(tmp_path):
    cfg = tiny_gpt_pretrain_config(save=str(tmp_path))
    with pytest.raises(ValueError, match=r"no 'Starting job' line written with 1 rank"):
        mb_train.get_start_time_from_progress_log(cfg)
    with pytest.raises(ValueError, match=r"needs cfg.checkpoint.save"):
        mb_train.get_start_time_from_progress_log(tiny_gpt_pretrain_config())
    mb_train.compute_throughputs_and_append_to_progress_log(GlobalState(ConfigContainer()), 1.0)
    assert not (tmp_path / "progress.txt").exists()  # no checkpoint.save: nothing written
    (tmp_path / "progress.txt").write_text(
        "2026-01-01 00:00:00\tJob ID: \t# GPUs: 1\tStarting job\n"
        "2026-01-01 01:00:00\tJob ID: \t# GPUs: 1\tSaved checkpoint\tIteration: 5\t"
        "Job throughput: 1.0 MODEL_TFLOP/s/GPU\tCumulative throughput: 1.0 MODEL_TFLOP/s/GPU\t"
        "Floating-point operations: 3.00e+12\tTokens (in billions): 0.00\n"
    )
    started, flops = mb_train.get_start_time_from_progress_log(cfg)
    assert (started.year, started.hour, flops) == (2026, 0, 0.0)


# -- what only Megatron-Core objects have


class HookedChunk(torch.nn.Linear):
    """A chunk with Megatron-Core DDP's pre-hook switches, recording the calls."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.calls: list[Any] = []

    def enable_forward_pre_hook(self) -> None:
        self.calls.append("enable")

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        self.calls.append(("disable", param_sync))


def test_forward_pre_hooks_are_switched_where_a_chunk_has_them_and_skipped_elsewhere():
    hooked, plain = HookedChunk(), torch.nn.Linear(2, 2)
    mb_train.enable_forward_pre_hook([hooked, plain])
    mb_train.disable_forward_pre_hook([hooked, plain], param_sync=False)
    assert hooked.calls == ["enable", ("disable", False)]
    answers = {
        flags: mb_train.should_disable_forward_pre_hook(*flags)
        for flags in [(False, True, True), (True, True, True), (False, False, True)]
    }
    assert answers == {
        (False, True, True): True,
        (True, True, True): False,
        (False, False, True): False,
    }
    with pytest.raises(TypeError, match=r"use_distributed_optimizer must be True or False"):
        mb_train.should_disable_forward_pre_hook(False, "yes", True)
    with pytest.raises(TypeError, match=r"model must be a list of torch modules"):
        mb_train.enable_forward_pre_hook([object()])


def test_the_mxfp8_buffer_copy_reaches_chained_distributed_optimizers_only(monkeypatch):
    """Only Megatron-Core's DistributedOptimizer is refreshed, as in Megatron-Bridge: another
    optimizer with a method of the same name is left alone."""
    copied: list[str] = []

    class DistributedOptimizer:  # stands in for Megatron-Core's class, in its module
        def __init__(self, name: str) -> None:
            self.name = name

        def _copy_main_params_to_param_buffer(self) -> None:
            copied.append(self.name)

    class LookAlike:  # the same method, but not a DistributedOptimizer
        def __init__(self, name: str) -> None:
            self.name = name

        def _copy_main_params_to_param_buffer(self) -> None:
            copied.append(self.name)

    chained = SimpleNamespace(
        chained_optimizers=[
            DistributedOptimizer("first"),
            LookAlike("other"),
            DistributedOptimizer("second"),
        ]
    )
    mb_train._handle_mxfp8_param_buffer_copy(chained, True, True)
    assert copied == []  # Megatron-Core not loaded: no distributed optimizer can exist
    module = ModuleType("megatron.core.optimizer.distrib_optimizer")
    module.DistributedOptimizer = DistributedOptimizer
    monkeypatch.setitem(sys.modules, module.__name__, module)
    mb_train._handle_mxfp8_param_buffer_copy(chained, True, False)
    mb_train._handle_mxfp8_param_buffer_copy(chained, False, True)
    assert copied == []  # both flags are needed
    mb_train._handle_mxfp8_param_buffer_copy(chained, True, True)
    assert copied == ["first", "second"]
    torch_optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    mb_train._handle_mxfp8_param_buffer_copy(torch_optimizer, True, True)  # nothing to copy
    assert copied == ["first", "second"]


def test_post_step_work_runs_the_profiler_and_garbage_collection_when_due(monkeypatch):
    collected: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1))
    profiler = SimpleNamespace(steps=0)
    profiler.step = lambda: setattr(profiler, "steps", profiler.steps + 1)
    config = SimpleNamespace(train=SimpleNamespace(manual_gc=True, manual_gc_interval=2))
    for iteration in (1, 2, 3, 4):
        mb_train.post_training_step_callbacks(
            [torch.nn.Linear(2, 2)], 0.0, None, iteration, profiler, config, False
        )
    assert (profiler.steps, len(collected)) == (4, 2)


# -- pretrain(): the event before the data, and the validation samples


def test_pretrain_reads_its_corpus_after_on_data_init_start(monkeypatch):
    order: list[str] = []
    read = native_gpt.load_corpus
    monkeypatch.setattr(
        native_gpt, "load_corpus", lambda *a: order.append("corpus read") or read(*a)
    )
    manager = CallbackManager()
    manager.register("on_data_init_start", lambda ctx: order.append("on_data_init_start"))
    pretrain(tiny_gpt_pretrain_config(train_iters=1, eval_interval=None), forward_step, manager)
    assert order == ["on_data_init_start", "corpus read"]


def test_pretrain_counts_the_validation_and_test_samples_it_reads():
    seen: dict[str, int] = {}
    manager = CallbackManager()
    for event in ("on_train_end", "on_test_end"):
        manager.register(
            event,
            lambda ctx, e=event: seen.setdefault(e, ctx.state.train_state.consumed_valid_samples),
        )
    cfg = tiny_gpt_pretrain_config(train_iters=4, eval_interval=2, eval_iters=2)
    pretrain(cfg, forward_step, manager)
    per_pass = 2 * cfg.train.micro_batch_size  # eval_iters batches of one micro-batch
    assert seen == {"on_train_end": 2 * per_pass, "on_test_end": 4 * per_pass}


# -- two ranks

TWO_RANK_JOB = """
import json, sys
import torch
import torch.distributed as dist
from hookloop.compat.megatron_bridge.recipes import tiny_gpt_pretrain_config
from hookloop.compat.megatron_bridge.training import train as mb_train
from hookloop.compat.megatron_bridge.training.callbacks import CallbackManager
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.distributed import leave_process_group

dist.init_process_group("gloo")
rank = dist.get_rank()
cfg = tiny_gpt_pretrain_config(train_iters=2, eval_interval=2)
cfg.train.global_batch_size = 16  # two micro-batches of 4 on each of the two ranks
cfg.train.exit_duration_in_mins = 1e6  # agreed over the ranks after every step
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def batches(seed):
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(4, 3, generator=gen) * (1 + rank)


def step(data_iterator, model):
    out = model(next(data_iterator))

    def loss_func(output):
        total, tokens = (output**2).sum(), torch.tensor(float(output.numel()))
        return total, tokens, {"lm loss": torch.stack([total.detach(), tokens])}

    return out, loss_func


seen = {"train": [], "valid": []}
manager = CallbackManager()
manager.register(
    "on_train_step_end", lambda ctx: seen["train"].append(float(ctx.loss_dict["lm loss"]))
)
manager.register(
    "on_eval_end", lambda ctx: seen["valid"].append(float(ctx.total_loss_dict["lm loss"]))
)
mb_train.train(
    step, [model], optimizer, None, batches(rank), batches(10 + rank), GlobalState(cfg), {},
    callback_manager=manager,
)
seen["params"] = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(seen, f)
# every rank at a barrier before the group goes: a rank that destroys it while its peer's
# gloo threads still talk to it can make that peer abort at exit (SIGABRT)
leave_process_group()
"""


def test_two_ranks_agree_on_losses_validation_and_weights(tmp_path):
    import json
    import subprocess

    job = tmp_path / "job.py"
    job.write_text(TWO_RANK_JOB)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*cmd, str(job), str(tmp_path)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(first["train"]) == 2 and len(first["valid"]) == 1
    # Each rank reads other data; the [sum, count] losses are reduced over both ranks.
    assert first["train"] == pytest.approx(second["train"])
    assert first["valid"] == pytest.approx(second["valid"])
    assert first["params"] == pytest.approx(second["params"])  # DDP averaged the gradients
