"""Megatron-Bridge's GlobalState writers, signatures, config fields and exit signal, as
its own code uses them: ``GlobalState(cfg)`` then ``training.train``, ``pretrain``,
``save_checkpoint``, ``evaluate`` and ``finetune`` called with Megatron-Bridge's arguments."""

from __future__ import annotations

import gc
import inspect
import logging
import os
import signal
from typing import Any

import pytest
import torch

import hookloop.recipes.gpt as native_gpt
from hookloop.compat.megatron_bridge.recipes import tiny_gpt_pretrain_config
from hookloop.compat.megatron_bridge.training import checkpointing, loggers
from hookloop.compat.megatron_bridge.training import eval as mb_eval
from hookloop.compat.megatron_bridge.training import train as mb_train
from hookloop.compat.megatron_bridge.training.callbacks import CallbackManager
from hookloop.compat.megatron_bridge.training.config import ConfigContainer
from hookloop.compat.megatron_bridge.training.finetune import finetune
from hookloop.compat.megatron_bridge.training.gpt_step import forward_step
from hookloop.compat.megatron_bridge.training.pretrain import pretrain
from hookloop.compat.megatron_bridge.training.state import GlobalState, TrainState
from hookloop.compat.megatron_bridge.training.utils.log_utils import setup_logging
from hookloop.compat.megatron_bridge.training.utils.train_utils import maybe_inject_state

EMPTY = inspect.Parameter.empty
POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD


def byte_batches(seed: int) -> Any:
    """Endless (inputs, targets) micro-batches of 4 random 32-byte windows."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, 256, (4, 32), generator=gen)
        yield x, torch.roll(x, -1, dims=1)


def train_with(cfg: ConfigContainer, state: GlobalState, manager: CallbackManager | None = None):
    """``training.train`` on a small GPT, as user code that builds its own objects calls it."""
    torch.manual_seed(0)
    model = native_gpt.GPT(cfg.gpt_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr)
    mb_train.train(
        forward_step,
        [model],
        optimizer,
        None,
        byte_batches(1),
        byte_batches(2),
        state,
        {},
        callback_manager=manager,
    )
    return model, optimizer


def scalars(directory: Any) -> dict[str, dict[int, float]]:
    """Every scalar tag in the TensorBoard event files under ``directory``, read back by
    TensorBoard's own reader: ``{tag: {step: value}}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


# -- the writers GlobalState opens


def test_global_state_of_a_container_opens_tensorboard_and_train_writes_megatron_tags(tmp_path):
    cfg = tiny_gpt_pretrain_config(train_iters=4, eval_interval=2)
    cfg.logger.tensorboard_dir = str(tmp_path / "tb")
    state = GlobalState(cfg)
    assert not (tmp_path / "tb").exists()  # opened on first use, as Megatron-Bridge's
    losses: dict[int, float] = {}
    manager = CallbackManager()

    def keep(ctx) -> None:  # logged at the step count after the step, as Megatron-Bridge
        losses[ctx.state.train_state.step + 1] = float(ctx.loss_dict["lm loss"])

    manager.register("on_train_step_end", keep)
    train_with(cfg, state, manager)
    state.close_loggers()

    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    read = scalars(tmp_path / "tb")
    assert read["lm loss"] == pytest.approx(losses)
    assert sorted(read["learning-rate"]) == [1, 2, 3, 4]
    assert read["learning-rate"][1] == pytest.approx(cfg.optimizer.lr)
    assert set(read["batch-size"].values()) == {8.0}
    assert sorted(read["grad-norm"]) == [1, 2, 3, 4]
    # "<tag> vs samples": the same values against the consumed samples (8 a step)
    assert read["lm loss vs samples"] == pytest.approx({8 * s: v for s, v in losses.items()})
    assert sorted(read["lm loss validation"]) == [2, 4]
    assert sorted(read["lm loss validation vs samples"]) == [16, 32]
    assert "lm loss validation ppl" not in read  # only with log_validation_ppl_to_tensorboard


def test_cfg_set_after_construction_opens_the_writers_it_names_on_the_last_rank_only(
    tmp_path, monkeypatch
):
    cfg = tiny_gpt_pretrain_config()
    cfg.logger.tensorboard_dir = str(tmp_path / "tb")
    state = GlobalState()  # Megatron-Bridge's way: the config is set afterwards
    assert state.tensorboard_logger is None and state.wandb_logger is None
    state.cfg = cfg
    writer = state.tensorboard_logger
    assert writer is not None and writer.log_dir == str(tmp_path / "tb")
    assert state.tensorboard_logger is writer  # one writer, reused
    state.close_loggers()

    other = GlobalState(cfg)
    monkeypatch.setattr(loggers, "rank_info", lambda: (0, 0, 2))  # rank 0 of 2: not the last
    assert other.tensorboard_logger is None
    monkeypatch.setattr(loggers, "rank_info", lambda: (1, 1, 2))
    assert other.tensorboard_logger is not None
    other.close_loggers()


def test_pretrain_writes_megatron_tags_to_an_offline_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from hookloop.callbacks.wandb_logger import offline_history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    cfg = tiny_gpt_pretrain_config(train_iters=4, eval_interval=2)
    cfg.logger.wandb_project = "hookloop-tests"
    cfg.logger.wandb_exp_name = "megatron-tags"
    cfg.logger.wandb_save_dir = str(tmp_path / "wb")
    cfg.logger.log_validation_ppl_to_tensorboard = True
    result = pretrain(cfg, forward_step)

    assert list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    rows = offline_history(tmp_path / "wb" / "wandb", wait_s=30)
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        by_step.setdefault(row["_step"], {}).update(row)
    assert sorted(by_step) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert {"learning-rate", "batch-size", "lm loss", "grad-norm"} <= set(by_step[step])
        assert by_step[step]["samples vs steps"] == 8 * step
    assert {"lm loss validation", "lm loss validation ppl"} <= set(by_step[2])
    assert by_step[4]["lm loss test"] == pytest.approx(result.metrics["test_lm loss"])


# -- signatures, return values and errors


def shape(fn: Any) -> list[tuple[str, Any, Any]]:
    """``(name, kind, default)`` of each parameter of ``fn``."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_save_checkpoint_and_the_evaluations_take_megatron_bridges_parameters():
    # Megatron-Bridge's parameters, in its order (its newer callback_manager/is_test tail,
    # none keyword-only), with its defaults; the Megatron-Core ones must stay None.
    assert shape(checkpointing.save_checkpoint) == [
        ("state", POSITIONAL, EMPTY),
        ("model", POSITIONAL, EMPTY),
        ("optimizer", POSITIONAL, EMPTY),
        ("opt_param_scheduler", POSITIONAL, EMPTY),
        ("num_floating_point_operations_so_far", POSITIONAL, EMPTY),
        ("checkpointing_context", POSITIONAL, None),
        ("pipeline_rank", POSITIONAL, None),
        ("tensor_rank", POSITIONAL, None),
        ("non_persistent_ckpt", POSITIONAL, False),
        ("train_data_iterator", POSITIONAL, None),
        ("preprocess_common_state_dict_fn", POSITIONAL, None),
        ("prebuilt_state_dict", POSITIONAL, None),
        ("pg_collection", POSITIONAL, None),
        ("callback_manager", POSITIONAL, None),
        ("module_name", POSITIONAL, None),
    ]
    evaluation_tail = [
        ("p2p_communicator", POSITIONAL, None),
        ("pg_collection", POSITIONAL, None),
        ("callback_manager", POSITIONAL, None),
        ("is_test", POSITIONAL, False),
    ]
    assert shape(mb_eval.evaluate) == [
        ("state", POSITIONAL, EMPTY),
        ("forward_step_func", POSITIONAL, EMPTY),
        ("data_iterator", POSITIONAL, EMPTY),
        ("model", POSITIONAL, EMPTY),
        ("process_non_loss_data_func", POSITIONAL, EMPTY),
        ("config", POSITIONAL, EMPTY),
        ("verbose", POSITIONAL, False),
        ("non_loss_data_func", POSITIONAL, None),
        *evaluation_tail,
    ]
    assert shape(mb_eval.evaluate_and_print_results) == [
        ("state", POSITIONAL, EMPTY),
        ("prefix", POSITIONAL, EMPTY),
        ("forward_step_func", POSITIONAL, EMPTY),
        ("data_iterator", POSITIONAL, EMPTY),
        ("model", POSITIONAL, EMPTY),
        ("config", POSITIONAL, EMPTY),
        ("verbose", POSITIONAL, False),
        ("write_to_tensorboard", POSITIONAL, True),
        ("process_non_loss_data_func", POSITIONAL, None),
        ("non_loss_data_func", POSITIONAL, None),
        *evaluation_tail,
    ]
    # finetune(config, forward_step_func, callbacks=None), then hookloop's keywords
    assert shape(finetune)[:3] == [
        ("config", POSITIONAL, EMPTY),
        ("forward_step_func", POSITIONAL, EMPTY),
        ("callbacks", POSITIONAL, None),
    ]
    assert {p.kind for p in inspect.signature(finetune).parameters.values()} - {POSITIONAL} == {
        inspect.Parameter.KEYWORD_ONLY
    }


def small_model(cfg: ConfigContainer) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [native_gpt.GPT(cfg.gpt_config())]


def test_save_checkpoint_called_as_megatron_bridge_calls_it(tmp_path):
    cfg = tiny_gpt_pretrain_config(save=str(tmp_path))
    state = GlobalState(cfg)
    state.train_state.step = 3
    model = small_model(cfg)
    optimizer = torch.optim.AdamW(model[0].parameters())
    context: dict[str, Any] = {}
    # positional FLOPs count, then the checkpointing context, as Megatron-Bridge passes them
    assert checkpointing.save_checkpoint(state, model, optimizer, None, 1.5e9, context) is None
    assert (tmp_path / "checkpoints" / "step-00000003").is_dir()
    # no context at all is allowed too (Megatron-Bridge's default)
    state.train_state.step = 4
    checkpointing.save_checkpoint(state, model, optimizer, None, 2e9)
    assert (tmp_path / "checkpoints" / "step-00000004").is_dir()
    with pytest.raises(ValueError, match=r"save_checkpoint\(pipeline_rank=1\) needs Megatron-Core"):
        checkpointing.save_checkpoint(state, model, optimizer, None, 0, {}, 1)
    with pytest.raises(ValueError, match=r"non_persistent_ckpt=True\) needs Megatron-Core"):
        checkpointing.save_checkpoint(state, model, optimizer, None, 0, non_persistent_ckpt=True)


def test_evaluate_returns_megatron_bridges_three_values_and_stops_at_the_time_limit():
    cfg = tiny_gpt_pretrain_config(eval_iters=2)
    state = GlobalState(cfg)
    model = small_model(cfg)
    losses, non_loss, timelimit_hit = mb_eval.evaluate(
        state, forward_step_with(state), byte_batches(3), model, None, cfg.model
    )
    assert set(losses) == {"lm loss"} and non_loss is None and timelimit_hit is False
    assert state.train_state.consumed_valid_samples == 2 * 8
    printed = mb_eval.evaluate_and_print_results(
        state, "iteration 0", forward_step_with(state), byte_batches(3), model, cfg.model
    )
    assert printed is not None and float(printed["lm loss"]) == pytest.approx(
        float(losses["lm loss"])
    )

    cfg.train.exit_duration_in_mins = 1.0
    state.start_time -= 120.0  # the job started two minutes ago: the limit has passed
    assert mb_eval.evaluate(
        state, forward_step_with(state), byte_batches(3), model, None, cfg.model
    ) == (None, None, True)
    assert model[0].training  # back in training mode after an early stop
    assert (
        mb_eval.evaluate_and_print_results(
            state, "iteration 0", forward_step_with(state), byte_batches(3), model, cfg.model
        )
        is None
    )


def forward_step_with(state: GlobalState) -> Any:
    return lambda data_iterator, model: forward_step(state, data_iterator, model)


def test_finetune_without_weights_or_a_run_to_resume_asserts_as_megatron_bridge():
    with pytest.raises(
        AssertionError, match=r"pretrained_checkpoint .* or config\.checkpoint\.load"
    ):
        finetune(tiny_gpt_pretrain_config(), forward_step)


# -- config fields Megatron-Bridge users set


def lrs_of(cfg: ConfigContainer) -> list[float]:
    """The learning rate of each step of a ``pretrain`` run of ``cfg``."""
    seen: list[float] = []
    manager = CallbackManager()
    manager.register(
        "on_train_step_start", lambda ctx: seen.append(ctx.optimizer.param_groups[0]["lr"])
    )
    pretrain(cfg, forward_step, callbacks=manager)
    return seen


def test_train_samples_becomes_iterations_over_the_global_batch():
    cfg = tiny_gpt_pretrain_config(eval_interval=None)
    cfg.train.train_iters = None
    cfg.train.train_samples = 47  # 5 global batches of 8, the rest dropped
    assert pretrain(cfg, forward_step).step == 5
    assert cfg.train.train_iters == 5
    cfg.train.train_samples = 64  # train_iters (5, set above) and train_samples disagree
    with pytest.raises(ValueError, match=r"set train\.train_iters \(5\) or train\.train_samples"):
        cfg.validate()


def test_scheduler_decay_and_warmup_fields_drive_the_schedule():
    cfg = tiny_gpt_pretrain_config(train_iters=6, eval_interval=None, lr=1e-2)
    cfg.scheduler.lr_decay_style = "linear"
    cfg.scheduler.lr_decay_iters = 4  # decays to min_lr over 4 steps, then stays there
    cfg.scheduler.lr_warmup_fraction = 0.5  # warm up over half of the decay: 2 steps
    lrs = lrs_of(cfg)
    assert cfg.schedule_iterations() == (2, 4)
    # as Megatron: warm up to the peak, then decay over lr_decay_iters - warm-up steps
    assert lrs == pytest.approx([5e-3, 1e-2, 1e-2, 5.5e-3, 1e-3, 1e-3])

    by_samples = tiny_gpt_pretrain_config(eval_interval=None, lr=1e-2)
    by_samples.train.train_iters = None
    by_samples.train.train_samples = 32
    by_samples.scheduler.lr_decay_style = "linear"
    by_samples.scheduler.lr_warmup_samples = 16  # 2 global batches
    by_samples.validate()
    assert by_samples.schedule_iterations() == (2, 4)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"lr_decay_samples": 64}, r"scheduler\.lr_decay_samples does not fit a run counted by"),
        ({"lr_warmup_fraction": 0.1, "lr_warmup_iters": 2}, r"lr_warmup_fraction, lr_warmup"),
        ({"lr_warmup_fraction": 1.5}, r"lr_warmup_fraction must lie in \[0, 1\]"),
        ({"lr_warmup_init": 1e-4}, r"lr_warmup_init must be 0\.0"),
        ({"lr_decay_iters": 0}, r"scheduler\.lr_decay_iters must be an int >= 1"),
    ],
)
def test_scheduler_fields_are_checked_by_name(setting, message):
    cfg = tiny_gpt_pretrain_config()
    for name, value in setting.items():
        setattr(cfg.scheduler, name, value)
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def test_a_megatron_bridge_field_the_dialect_lacks_is_refused_by_name():
    cfg = tiny_gpt_pretrain_config()
    with pytest.raises(AttributeError, match=r"^train\.rampup_batch_size is a Megatron-Bridge"):
        cfg.train.rampup_batch_size = [16, 8, 300_000]
    with pytest.raises(AttributeError, match=r"Did you mean 'lr_decay_iters'\?"):
        cfg.scheduler.lr_decay_iter = 10
    with pytest.raises(AttributeError, match=r"^tokenizer is a Megatron-Bridge setting"):
        cfg.tokenizer = object()


# -- exit_signal_handler


def test_sigterm_during_train_saves_and_exits_when_exit_signal_handler_is_set(tmp_path):
    cfg = tiny_gpt_pretrain_config(train_iters=6, eval_interval=None, save=str(tmp_path))
    cfg.train.exit_signal_handler = True
    state = GlobalState(cfg)
    manager = CallbackManager()
    ends: list[int] = []

    def signal_at_step_one(ctx) -> None:
        ends.append(ctx.state.train_state.step)
        if ctx.state.train_state.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler stopping the job

    manager.register("on_train_step_end", signal_at_step_one)
    manager.register("on_train_end", lambda ctx: ends.append(-1))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        train_with(cfg, state, manager)
    assert info.value.code == 0
    assert ends == [0, 1]  # the step finished, then the run stopped, without on_train_end
    assert state.train_state.step == 2
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert saved == ["step-00000002"]
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back


# -- smaller items


def test_train_state_checkpoints_megatron_bridges_tensor_types():
    state = TrainState(step=3, consumed_train_samples=24, floating_point_operations_so_far=1e12)
    tensors = state.state_dict()
    assert {k: v.dtype for k, v in tensors.items()} == {
        "step": torch.int32,
        "consumed_train_samples": torch.int32,
        "skipped_train_samples": torch.int32,
        "consumed_valid_samples": torch.int32,
        "floating_point_operations_so_far": torch.float64,
        "do_train": torch.bool,
        "do_valid": torch.bool,
        "do_test": torch.bool,
    }
    again = TrainState()
    again.load_state_dict(tensors)
    assert again == state


def test_setup_logging_sets_megatron_bridge_loggers_from_the_environment(monkeypatch):
    train_logger = logging.getLogger("megatron.bridge.training.train")
    other = logging.getLogger("some.other.library")
    root_level = logging.getLogger().level
    saved = train_logger.level, other.level
    monkeypatch.setenv("MEGATRON_BRIDGE_LOGGING_LEVEL", str(logging.ERROR))
    try:
        setup_logging(logging_level=logging.DEBUG, filter_warning=False)
        assert train_logger.level == logging.ERROR and logging.getLogger().level == logging.ERROR
        assert other.level == saved[1]
    finally:
        logging.getLogger().setLevel(root_level)
        train_logger.setLevel(saved[0])


def test_maybe_inject_state_binds_the_state_for_steps_that_ask_for_it():
    class Functor:
        def __call__(self, state, data_iterator, model, return_schedule_plan=False):
            return state, return_schedule_plan

    def annotated(first: GlobalState, data_iterator, model):
        return first

    def no_state(data_iterator, model, return_schedule_plan=False):
        return "no state"

    state = GlobalState()
    assert maybe_inject_state(Functor(), state)(iter([]), None, return_schedule_plan=True) == (
        state,
        True,
    )
    assert maybe_inject_state(annotated, state)(iter([]), None) is state
    assert maybe_inject_state(no_state, state) is no_state  # three parameters, none the state
    assert maybe_inject_state(no_state, state, needs_injection=True).args == (state,)


def test_manual_gc_turns_the_collector_off_and_collects_at_megatron_bridges_points():
    cfg = tiny_gpt_pretrain_config(train_iters=4, eval_interval=2)
    cfg.train.manual_gc = True
    cfg.train.manual_gc_interval = 2
    collections: list[int] = []
    enabled_during: list[bool] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and not gc.isenabled():  # explicit ones: automatic is off
            collections.append(info["generation"])

    manager = CallbackManager()
    manager.register("on_train_step_end", lambda ctx: enabled_during.append(gc.isenabled()))
    assert gc.isenabled()
    gc.callbacks.append(record)
    try:
        train_with(cfg, GlobalState(cfg), manager)
    finally:
        gc.callbacks.remove(record)
    assert enabled_during == [False] * 4
    assert gc.isenabled()  # on again after the loop
    # one full collection at the start; at steps 2 and 4 the validation's (a full one
    # before, a young-generation one after), then the interval's
    assert collections == [2, 2, 0, 2, 2, 0, 2]
