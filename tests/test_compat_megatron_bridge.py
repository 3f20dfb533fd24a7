"""The Megatron-Bridge dialect: its docs' examples run as written, context fields, order,
bad input.

Megatron-Bridge's examples are cut out of its documentation at run time
(``_reference_examples``) and
only their ``megatron.bridge`` import lines are swapped for this package; the
Qwen config function becomes ``small_gpt_pretrain_config``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from _golden import golden_run_config
from _reference_examples import example, with_imports
from hookloop import Callback as NativeCallback
from hookloop import Trainer
from hookloop.compat.mapping import dialect_events
from hookloop.compat.megatron_bridge.recipes import (
    small_gpt_pretrain_config,
    tiny_gpt_pretrain_config,
)
from hookloop.compat.megatron_bridge.training import callbacks as mb_callbacks
from hookloop.compat.megatron_bridge.training.callbacks import (
    Callback,
    CallbackContext,
    CallbackManager,
)
from hookloop.compat.megatron_bridge.training.config import ConfigContainer
from hookloop.compat.megatron_bridge.training.finetune import finetune
from hookloop.compat.megatron_bridge.training.gpt_step import forward_step
from hookloop.compat.megatron_bridge.training.pretrain import pretrain
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.testing import TinyModel, ToyData
from hookloop.timers import LOOP_TIMERS
from test_trace import EXPECTED as NATIVE_EXPECTED

MB = "hookloop.compat.megatron_bridge"
QWEN_IMPORT = "from megatron.bridge.recipes.qwen import qwen25_500m_pretrain_config"
SMALL_GPT_IMPORT = (
    f"from {MB}.recipes.gpt import small_gpt_pretrain_config as qwen25_500m_pretrain_config"
)


@pytest.fixture(autouse=True)
def _one_thread():
    """The small GPT is overhead-bound: one thread is ~10x faster on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def translated(code: str) -> str:
    """``code`` with every ``megatron.bridge`` import pointed at this package (and nothing else)."""
    swaps = {}
    for line in code.splitlines():
        stripped = line.strip()
        if stripped == QWEN_IMPORT:
            swaps[stripped] = SMALL_GPT_IMPORT
        elif stripped.startswith("from megatron.bridge."):
            swaps[stripped] = stripped.replace("megatron.bridge", MB, 1)
    out = with_imports(code, swaps)
    assert "megatron.bridge" not in out
    return out


def run(code: str, **names: Any) -> dict[str, Any]:
    """Execute ``code`` in a fresh namespace holding ``names``; return the namespace."""
    namespace: dict[str, Any] = {"__name__": "documented_example", **names}
    exec(compile(code, "<Megatron-Bridge example>", "exec"), namespace)
    return namespace


def printed(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().out.splitlines()


# Megatron-Bridge's loss_dict: the loss function's own keys, 0-dim tensors.
LOSS_DICT = r"\{'lm loss': tensor\([\d.]+\)\}"


# -- Megatron-Bridge's callback docs: every code example runs as written ----------


def test_class_based_quick_start_prints_start_each_step_and_duration(capsys):
    run(
        translated(
            example(
                "megatron_bridge_callbacks",
                "import time",
                "pretrain(config, forward_step, callbacks=[MyCallback()])",
            )
        )
    )

    lines = printed(capsys)
    assert lines[0] == "Training started at step 0"
    for step, line in enumerate(lines[1:5]):  # Megatron-Bridge: the first step reads 0
        assert re.fullmatch(rf"Step {step}: loss={LOSS_DICT}", line), line
    assert re.fullmatch(r"Training completed in \d+\.\d\ds", lines[5])
    assert len(lines) == 6


def test_functional_callback_registered_on_a_manager_logs_every_step(capsys):
    code = example(
        "megatron_bridge_callbacks",
        "from megatron.bridge.training.callbacks import CallbackManager",
        "pretrain(config, forward_step, callbacks=callback_manager)",
    )
    run(translated(code))

    lines = printed(capsys)
    assert len(lines) == 4
    for step, line in enumerate(lines):
        assert re.fullmatch(rf"Step {step}: {LOSS_DICT}", line), line


def test_mixing_classes_and_functions_runs_all_of_them(capsys):
    # The example uses MyCallback (defined by the quick-start example, run here from the
    # docs), TimingCallback and MetricsCallback (never defined in the docs: ours, below).
    namespace = run(
        translated("from megatron.bridge.training.callbacks import Callback\nimport time\n")
        + example(
            "megatron_bridge_callbacks",
            "class MyCallback(Callback):",
            'print(f"Training completed in {elapsed:.2f}s")',
        )
    )
    seen: list[str] = []

    class TimingCallback(Callback):
        def on_train_step_start(self, context):
            seen.append(f"timing {context.state.train_state.step}")

    class MetricsCallback(Callback):
        def on_train_step_end(self, context):
            seen.append(f"metrics {context.state.train_state.step}")

    code = example(
        "megatron_bridge_callbacks",
        "from megatron.bridge.training.callbacks import CallbackManager",
        "pretrain(config, forward_step, callbacks=manager)",
        occurrence=2,
    )
    run(
        translated(code),
        MyCallback=namespace["MyCallback"],
        TimingCallback=TimingCallback,
        MetricsCallback=MetricsCallback,
    )

    lines = printed(capsys)
    assert lines[0] == "Training started at step 0"
    # eval_interval=2 over 4 steps, then the validation after training (after on_train_end)
    assert lines.count("Evaluation complete!") == 3
    assert re.fullmatch(r"Training completed in \d+\.\d\ds", lines[-2])
    assert lines[-1] == "Evaluation complete!"
    assert seen == [f"{kind} {step}" for step in range(4) for kind in ("timing", "metrics")]


def test_user_state_is_shared_across_a_callbacks_events(capsys):
    code = example(
        "megatron_bridge_callbacks",
        "class StepCounterCallback(Callback):",
        "print(f\"Callback saw {context.user_state['callback_step_count']} steps\")",
    )
    namespace = run(code, Callback=Callback)
    manager = CallbackManager()
    manager.add(namespace["StepCounterCallback"]())

    pretrain(small_gpt_pretrain_config(), forward_step, callbacks=manager)

    assert printed(capsys) == ["Callback saw 4 steps"]
    assert manager.user_state == {"callback_step_count": 4}


def test_rank_zero_guard_runs_in_a_process_group(capsys, tmp_path):
    import torch.distributed as dist

    code = example(
        "megatron_bridge_callbacks",
        "import torch.distributed as dist",
        'print(f"Step {context.state.train_state.step} complete")',
    )
    namespace = run(code, Callback=Callback)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        pretrain(
            small_gpt_pretrain_config(), forward_step, callbacks=[namespace["RankZeroCallback"]()]
        )
    finally:
        dist.destroy_process_group()

    assert printed(capsys) == [f"Step {step} complete" for step in range(4)]


class _Service:
    """Stands in for the docs' ``external_service`` (which they leave undefined)."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.logged: list[Any] = []

    def log(self, payload: Any) -> None:
        if self.fail:
            raise ConnectionError("service unreachable")
        self.logged.append(payload)


def test_safe_callback_example_keeps_training_when_its_service_fails(capsys):
    code = example(
        "megatron_bridge_callbacks",
        "def safe_callback(context):",
        "# Don't re-raise to avoid stopping training",
    )
    for fail in (True, False):
        service = _Service(fail)
        namespace = run(code, external_service=service)
        manager = CallbackManager()
        manager.register("on_train_step_end", namespace["safe_callback"])

        result = pretrain(small_gpt_pretrain_config(), forward_step, callbacks=manager)

        assert result.step == 4
        if fail:
            assert printed(capsys) == ["Callback failed: service unreachable"] * 4
        else:
            assert [sorted(d) for d in service.logged] == [["lm loss"]] * 4


def test_introspection_example_reports_registered_callbacks_and_event_names(capsys):
    code = example(
        "megatron_bridge_callbacks",
        "manager = CallbackManager()",
        "print(manager.events)  # frozenset of valid event names",
        occurrence=2,
    )
    # my_fn is left undefined by the docs; any function does.
    run(code, CallbackManager=CallbackManager, my_fn=lambda context: None)

    lines = printed(capsys)
    assert lines[:2] == ["Callbacks registered for on_train_start", "Found 1 callbacks"]
    assert eval(lines[2]) == set(mb_callbacks.VALID_EVENTS)
    assert len(lines) == 3


def test_proprietary_metrics_example_sends_step_lm_loss_and_grad_norm(monkeypatch):
    import os

    code = example("megatron_bridge_callbacks", "class ProprietaryMetricsCallback(Callback):", "})")
    sent: list[dict[str, Any]] = []

    class InternalMetricsClient:  # the docs' client is proprietary: a recorder stands in
        def __init__(self, endpoint: str) -> None:
            self.endpoint = endpoint

        def send(self, payload: dict[str, Any]) -> None:
            sent.append(payload)

    namespace = run(code, Callback=Callback, InternalMetricsClient=InternalMetricsClient, os=os)
    monkeypatch.setenv("CLUSTER_ID", "lab-7")

    callback = namespace["ProprietaryMetricsCallback"]("https://metrics.invalid")
    pretrain(small_gpt_pretrain_config(), forward_step, callbacks=[callback])

    assert [p["step"] for p in sent] == [0, 1, 2, 3]
    assert all(isinstance(p["loss"], torch.Tensor) and p["loss"] > 0 for p in sent)
    assert all(isinstance(p["grad_norm"], float) for p in sent)  # as Megatron-Core returns it
    assert {p["cluster_id"] for p in sent} == {"lab-7"}


# -- Megatron-Bridge's entry points: the forward-step protocol ------------------


def test_forward_step_signature_of_the_docs_matches_gpt_step():
    # The docs annotate with names from their own framework and typing; they are given here
    # (MegatronModule: a torch module). The example is a signature with a docstring only.
    from collections.abc import Callable as CallableType
    from typing import Any as AnyType

    code = example("megatron_bridge_entry_points", "def forward_step_func(", '"""')
    namespace = run(
        code,
        GlobalState=GlobalState,
        Iterable=Iterable,
        MegatronModule=torch.nn.Module,
        Any=AnyType,
        Callable=CallableType,
    )

    theirs = inspect.signature(namespace["forward_step_func"]).parameters
    ours = inspect.signature(forward_step).parameters
    assert [(p.name, p.default) for p in theirs.values()] == [
        (p.name, p.default) for p in ours.values()
    ]


def test_forward_step_receives_the_global_state_callbacks_see():
    config = small_gpt_pretrain_config(train_iters=2, eval_interval=None)
    seen: list[tuple[Any, int, bool]] = []

    def my_forward_step(global_state, data_iterator, model, return_schedule_plan=False):
        with_timer = global_state.timers("forward-step")
        with_timer.start()
        out = forward_step(global_state, data_iterator, model)
        with_timer.stop()
        seen.append((global_state, global_state.train_state.step, global_state.cfg is config))
        return out

    states: list[Any] = []
    manager = CallbackManager()
    manager.register("on_train_step_end", lambda context: states.append(context.state))

    pretrain(config, my_forward_step, callbacks=manager)

    # inside step N the counter reads N-1; the evaluation after training reads 2
    assert [(step, same_cfg) for _, step, same_cfg in seen] == [(0, True), (1, True)] + [
        (2, True)
    ] * 2
    assert all(state is seen[0][0] for state, _, _ in seen) and states == [seen[0][0]] * 2
    assert states[0].timers.names() == [*LOOP_TIMERS, "forward-step"]  # the loop's, then ours


def test_standard_loss_pattern_puts_its_meta_keys_in_loss_dict():
    def mean_loss_step(global_state, data_iterator, model):
        x, y = next(data_iterator)
        logits = model(x)

        def loss_func(output):
            loss = F.cross_entropy(output.reshape(-1, output.shape[-1]), y.reshape(-1))
            return loss, {"ce": loss.detach(), "double ce": 2 * loss.detach()}

        return logits, loss_func

    dicts: list[dict[str, Any]] = []
    manager = CallbackManager()
    manager.register("on_train_step_end", lambda context: dicts.append(context.loss_dict))

    pretrain(small_gpt_pretrain_config(train_iters=2), mean_loss_step, callbacks=manager)

    assert [sorted(d) for d in dicts] == [["ce", "double ce"]] * 2
    assert all(torch.allclose(d["double ce"], 2 * d["ce"]) for d in dicts)


def test_gpt_step_uses_the_token_aware_pattern_with_lm_loss():
    from hookloop.recipes.gpt import GPT

    config = small_gpt_pretrain_config()
    model = GPT(config.model)
    x = torch.randint(0, 256, (2, 8))
    output, loss_func = forward_step(GlobalState(config), iter([(x, x)]), model)

    loss_sum, num_tokens, meta = loss_func(output)
    assert int(num_tokens) == 16
    assert torch.allclose(meta["lm loss"], loss_sum / 16)


def test_return_schedule_plan_true_is_refused_with_the_reason():
    with pytest.raises(NotImplementedError, match="return_schedule_plan=False"):
        forward_step(None, iter([]), torch.nn.Linear(1, 1), return_schedule_plan=True)


# -- context fields -------------------------------------------------------------


class FieldRecorder(Callback):
    """Keeps what a callback author would read from the context at each event."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, int, dict[str, Any]]] = []

    def _keep(self, event: str, context: CallbackContext) -> None:
        self.rows.append(
            (
                event,
                context.state.train_state.step,
                {
                    "model": context.model,
                    "loss_dict": None if context.loss_dict is None else sorted(context.loss_dict),
                    "grad_norm": context.grad_norm,
                    "skipped_iter": context.skipped_iter,
                    "total_loss_dict": context.total_loss_dict,
                    "optimizer": context.optimizer,
                    "checkpoint_path": context.checkpoint_path,
                    "user_state": context.user_state,
                },
            )
        )


def _recording(event: str) -> Callable[[FieldRecorder, CallbackContext], None]:
    def record(self: FieldRecorder, context: CallbackContext) -> None:
        self._keep(event, context)

    return record


for _event in mb_callbacks.EVENT_NAMES:
    setattr(FieldRecorder, _event, _recording(_event))
del _event


def _rows(recorder: FieldRecorder, event: str) -> list[tuple[int, dict[str, Any]]]:
    return [(step, fields) for name, step, fields in recorder.rows if name == event]


def test_train_step_end_carries_loss_dict_grad_norm_and_skipped_iter():
    recorder = FieldRecorder()
    pretrain(small_gpt_pretrain_config(), forward_step, callbacks=[recorder])

    ends = _rows(recorder, "on_train_step_end")
    assert [step for step, _ in ends] == [0, 1, 2, 3]
    for _, fields in ends:
        assert fields["loss_dict"] == ["lm loss"]
        assert isinstance(fields["grad_norm"], float)
        assert fields["skipped_iter"] is False
        assert isinstance(fields["optimizer"], torch.optim.Optimizer)
    # Outside the step end the per-step fields are unset.
    for name in ("on_train_start", "on_train_step_start", "on_eval_end", "on_train_end"):
        for _, fields in _rows(recorder, name):
            assert fields["loss_dict"] is fields["grad_norm"] is fields["skipped_iter"] is None


def test_model_is_a_list_holding_the_one_model_chunk():
    recorder = FieldRecorder()
    pretrain(small_gpt_pretrain_config(train_iters=1), forward_step, callbacks=[recorder])

    models = [fields["model"] for _, _, fields in recorder.rows]
    assert all(isinstance(m, list) and len(m) == 1 for m in models)
    assert isinstance(models[0][0], torch.nn.Module)
    assert all(m[0] is models[0][0] for m in models)


def test_eval_end_carries_averaged_losses_under_megatron_bridges_keys():
    recorder = FieldRecorder()
    result = pretrain(small_gpt_pretrain_config(), forward_step, callbacks=[recorder])

    ends = _rows(recorder, "on_eval_end")
    assert [step for step, _ in ends] == [2, 4, 4]  # and the validation after training
    last = ends[-1][1]["total_loss_dict"]
    assert set(last) == {"lm loss"} and isinstance(last["lm loss"], torch.Tensor)
    assert float(last["lm loss"]) == pytest.approx(result.metrics["eval_lm loss"])
    assert all(fields["total_loss_dict"] is None for _, fields in _rows(recorder, "on_eval_start"))


def _tiny_trainer(manager: CallbackManager, **kw: Any) -> Trainer:
    """The golden run of tests/test_trace.py, with test data, serving ``manager``."""
    return Trainer(
        TinyModel(),
        train_data=ToyData(n=16),
        eval_data=ToyData(n=8, seed=1),
        test_data=ToyData(n=8, seed=2),
        loss_fn=TinyModel.loss_fn,
        config=golden_run_config(),
        callbacks=manager.native,
        **kw,
    )


def test_test_events_fire_on_trainer_test_with_total_loss_dict():
    recorder = FieldRecorder()
    manager = CallbackManager()
    manager.add(recorder)
    trainer = _tiny_trainer(manager)
    trainer.train()
    del recorder.rows[:]

    metrics = trainer.test()

    assert [(name, step) for name, step, _ in recorder.rows] == [
        ("on_test_start", 4),
        ("on_test_step_start", 4),
        ("on_test_step_end", 4),
        ("on_test_step_start", 4),
        ("on_test_step_end", 4),
        ("on_test_end", 4),
    ]
    assert recorder.rows[-1][2]["total_loss_dict"] == {
        "loss": pytest.approx(torch.tensor(metrics["test_loss"]))
    }


def test_checkpoint_save_and_load_events_fire_with_their_paths(tmp_path):
    recorder = FieldRecorder()
    config = small_gpt_pretrain_config(save_interval=2, eval_interval=None)
    pretrain(config, forward_step, callbacks=[recorder], out_dir=tmp_path)

    saves = _rows(recorder, "on_checkpoint_save")
    assert [step for step, _ in saves] == [2, 4]
    assert all(f["checkpoint_path"].parent == tmp_path / "checkpoints" for _, f in saves)

    again = FieldRecorder()
    longer = small_gpt_pretrain_config(train_iters=6, save_interval=2, eval_interval=None)
    pretrain(longer, forward_step, callbacks=[again], out_dir=tmp_path, resume="auto")

    assert [(name, step) for name, step, _ in again.rows][:2] == [
        ("on_data_init_start", 4),
        ("on_train_start", 4),
    ]
    assert [step for step, _ in _rows(again, "on_checkpoint_save")] == [6]


def _weights_at(manager: CallbackManager, event: str, into: list[float]) -> None:
    def keep(context: CallbackContext) -> None:
        into.append(sum(float(p.detach().sum()) for p in context.model[0].parameters()))

    manager.register(event, keep)


def test_finetune_starts_from_the_pretrained_weights(tmp_path):
    # The small GPT ties its embedding and output weights: the checkpoint stores them once.
    config = small_gpt_pretrain_config(train_iters=4)
    pre: list[float] = []
    manager = CallbackManager()
    _weights_at(manager, "on_train_start", pre)
    _weights_at(manager, "on_train_end", pre)
    pretrain(config, forward_step, callbacks=manager, out_dir=tmp_path)

    config.checkpoint.pretrained = str(tmp_path / "checkpoints")
    tuned: list[float] = []
    manager = CallbackManager()
    _weights_at(manager, "on_train_start", tuned)
    result = finetune(config, forward_step, callbacks=manager)

    assert tuned == [pytest.approx(pre[1])] and pre[1] != pytest.approx(pre[0])
    assert result.step == 4


def test_finetune_without_pretrained_weights_says_which_key_is_missing():
    with pytest.raises(ValueError, match=r"config\.checkpoint\.pretrained"):
        finetune(small_gpt_pretrain_config(), forward_step)


# -- golden trace -----------------------------------------------------------------


# The run of tests/test_trace.py (2 epochs of 2 steps, grad_accum 2, log every 2, eval every
# 3 and at each epoch end), then trainer.test(), seen through the dialect. Inside a step the
# step reads one lower than natively: Megatron-Bridge counts a step after it.
EXPECTED = [
    ("on_data_init_start", 0),
    ("on_train_start", 0),
    ("on_train_step_start", 0),
    ("on_train_step_end", 0),
    ("on_train_step_start", 1),
    ("on_train_step_end", 1),
    ("on_eval_start", 2),  # epoch-end evaluation
    ("on_eval_step_start", 2),
    ("on_eval_step_end", 2),
    ("on_eval_step_start", 2),
    ("on_eval_step_end", 2),
    ("on_eval_end", 2),
    ("on_train_step_start", 2),
    ("on_train_step_end", 2),
    ("on_eval_start", 3),  # eval_every=3
    ("on_eval_step_start", 3),
    ("on_eval_step_end", 3),
    ("on_eval_step_start", 3),
    ("on_eval_step_end", 3),
    ("on_eval_end", 3),
    ("on_train_step_start", 3),
    ("on_train_step_end", 3),
    ("on_eval_start", 4),  # epoch-end evaluation
    ("on_eval_step_start", 4),
    ("on_eval_step_end", 4),
    ("on_eval_step_start", 4),
    ("on_eval_step_end", 4),
    ("on_eval_end", 4),
    ("on_train_end", 4),
    ("on_test_start", 4),  # trainer.test()
    ("on_test_step_start", 4),
    ("on_test_step_end", 4),
    ("on_test_step_start", 4),
    ("on_test_step_end", 4),
    ("on_test_end", 4),
]


def test_dialect_event_order_matches_the_golden_trace():
    recorder = FieldRecorder()
    manager = CallbackManager()
    manager.add(recorder)
    trainer = _tiny_trainer(manager)
    trainer.train()
    trainer.test()

    assert [(event, step) for event, step, _ in recorder.rows] == EXPECTED


def test_golden_trace_is_the_native_one_seen_through_the_mapping():
    table = dialect_events("megatron_bridge")
    in_step = {"on_train_step_start", "on_train_step_end"}
    mapped = [
        (d, step - (d in in_step))
        for native, step, _ in NATIVE_EXPECTED
        for d in table.get(native, ())
        if d in mb_callbacks.VALID_EVENTS
    ]
    assert EXPECTED[: len(mapped)] == mapped


# -- manager behaviour -------------------------------------------------------------


def test_callbacks_fire_in_registration_order_across_add_and_register():
    order: list[str] = []

    class Named(Callback):
        def __init__(self, name: str) -> None:
            self.name = name

        def on_train_start(self, context):
            order.append(self.name)

    manager = CallbackManager()
    manager.add(Named("first"))
    manager.register("on_train_start", lambda context: order.append("second"))
    manager.add([Named("third"), Named("fourth")])
    _tiny_trainer(manager).train()

    assert order == ["first", "second", "third", "fourth"]
    owners = [getattr(fn, "__self__", None) for fn in manager.list_callbacks("on_train_start")]
    assert [getattr(owner, "name", None) for owner in owners] == ["first", None, "third", "fourth"]


def test_an_empty_manager_adds_no_native_handlers():
    manager = CallbackManager()
    assert not any(manager.native.index.values())
    assert manager.events == mb_callbacks.VALID_EVENTS


def test_native_callbacks_share_the_run_and_user_state():
    class Native(NativeCallback):
        def on_log(self, ctx):
            ctx.user_state["logs"] = ctx.user_state.get("logs", 0) + 1

    seen: list[int] = []
    manager = CallbackManager()
    manager.native.add(Native())
    manager.register("on_train_end", lambda context: seen.append(context.user_state["logs"]))
    _tiny_trainer(manager).train()

    assert seen == [2]  # log_every=2 over 4 steps


def test_an_exception_in_a_callback_propagates_naming_the_callback():
    class Broken(Callback):
        def on_train_step_end(self, context):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        pretrain(small_gpt_pretrain_config(), forward_step, callbacks=[Broken()])
    assert any("on_train_step_end" in note for note in info.value.__notes__)


# -- bad input ---------------------------------------------------------------------


def test_registering_an_unknown_event_suggests_the_closest_name():
    # Megatron-Bridge's message, then the closest name
    with pytest.raises(
        ValueError,
        match=r"^Unknown event 'on_trian_start'\. Valid events: frozenset\(\{.*\}\) "
        r"Did you mean 'on_train_start'\?$",
    ):
        CallbackManager().register("on_trian_start", print)


def test_registering_a_native_only_event_points_to_the_native_manager():
    with pytest.raises(ValueError, match=r"'on_before_log' is a native hookloop event.*native"):
        CallbackManager().register("on_before_log", print)


def test_registering_something_not_callable_is_refused():
    with pytest.raises(TypeError, match=r"needs a callable fn\(context\).*got str"):
        CallbackManager().register("on_train_start", "print")


def test_a_misspelt_callback_method_is_accepted_with_a_warning(caplog):
    class Typo(Callback):
        def on_train_step_ends(self, context): ...

        def on_custom_helper(self, context): ...  # Megatron-Bridge ignores other on_* names

    manager = CallbackManager()
    with caplog.at_level("WARNING"):
        manager.add(Typo())
    assert not any(manager.has_callbacks(e) for e in mb_callbacks.VALID_EVENTS)
    [record] = caplog.records
    assert re.search(
        r"Typo.on_train_step_ends matches no event.*'on_train_step_end'", record.message
    )


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (Callback, r"got the class Callback; write add\(Callback\(\)\)"),
        (NativeCallback(), r"native hookloop.Callback; add it to manager.native"),
        (print, r"takes a Callback .* or a list of them, got builtin_function_or_method"),
        ([Callback(), 3], r"got int"),
    ],
)
def test_adding_something_that_is_not_a_callback_says_what_is_expected(bad, message):
    with pytest.raises(TypeError, match=message):
        CallbackManager().add(bad)


def test_adding_the_same_callback_twice_runs_it_twice_as_megatron_bridge_does():
    class Once(Callback):
        def on_train_start(self, context): ...

    manager, callback = CallbackManager(), Once()
    manager.add(callback)
    manager.add(callback)
    assert manager.list_callbacks("on_train_start") == [callback.on_train_start] * 2


@pytest.mark.parametrize(
    ("callbacks", "message"),
    [
        ("MyCallback", r"add\(\) takes a Callback .*got str"),
        ({"on_train_start": print}, r"add\(\) takes a Callback .*got dict"),
        (mb_callbacks.NativeCallbackManager(), r"native hookloop.CallbackManager"),
    ],
)
def test_pretrain_with_the_wrong_callbacks_type_says_what_is_allowed(callbacks, message):
    with pytest.raises(TypeError, match=message):
        pretrain(small_gpt_pretrain_config(), forward_step, callbacks=callbacks)


def test_pretrain_checks_config_and_forward_step_first():
    with pytest.raises(TypeError, match="config must be a hookloop Config"):
        pretrain({"train_iters": 4}, forward_step)
    with pytest.raises(TypeError, match=r"forward_step_func must be callable.*got NoneType"):
        pretrain(small_gpt_pretrain_config(), None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"train_iters": 0}, r"train_iters must be an int >= 1, got 0"),
        ({"seq_length": 2.5}, r"seq_length must be an int >= 1, got 2.5"),
        ({"eval_interval": -1}, r"eval_interval must be an int >= 1 or None, got -1"),
        ({"lr": 0}, r"lr must be a number > 0, got 0"),
    ],
)
def test_small_gpt_config_rejects_bad_overrides_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_gpt_pretrain_config(**overrides)


# -- the test phase, the writers in GlobalState, and Megatron-Bridge's ConfigContainer ----


def test_pretrain_runs_the_test_phase_at_the_end_when_the_config_has_test_data():
    recorder = FieldRecorder()
    result = pretrain(tiny_gpt_pretrain_config(train_iters=4), forward_step, callbacks=[recorder])

    names = [name for name, _, _ in recorder.rows]
    tail = names[names.index("on_train_end") :]
    assert tail == [
        "on_train_end",
        "on_eval_start",  # the validation after training, as Megatron-Bridge's pretrain
        *["on_eval_step_start", "on_eval_step_end"] * 2,
        "on_eval_end",
        "on_test_start",
        *["on_test_step_start", "on_test_step_end"] * 2,
        "on_test_end",
    ]  # fmt: skip  (eval_iters=2)
    [(step, fields)] = _rows(recorder, "on_test_end")
    assert step == 4
    assert fields["total_loss_dict"] == {
        "lm loss": pytest.approx(torch.tensor(result.metrics["test_lm loss"]))
    }


def test_no_test_phase_without_test_data_or_after_an_exit_interval():
    no_split = tiny_gpt_pretrain_config()
    no_split.dataset.split = "95,5,0"
    recorder = FieldRecorder()
    result = pretrain(no_split, forward_step, callbacks=[recorder])
    assert not any(name.startswith("on_test") for name, _, _ in recorder.rows)
    assert not any(key.startswith("test_") for key in result.metrics)
    # exit_interval: Megatron-Bridge exits the process (code 0), without on_train_end
    cut_short = tiny_gpt_pretrain_config(train_iters=6, eval_interval=None)
    cut_short.train.exit_interval = 2
    recorder = FieldRecorder()
    with pytest.raises(SystemExit) as info:
        pretrain(cut_short, forward_step, callbacks=[recorder])
    assert info.value.code == 0
    names = [name for name, _, _ in recorder.rows]
    assert names[-1] == "on_train_step_end" and names.count("on_train_step_end") == 2
    assert "on_train_end" not in names and "on_eval_start" not in names
    # the small native config's recipe has no test split: no test phase either
    recorder = FieldRecorder()
    pretrain(small_gpt_pretrain_config(), forward_step, callbacks=[recorder])
    assert not any(name.startswith("on_test") for name, _, _ in recorder.rows)


class LogsThroughTheStateWriters(Callback):
    """What a callback writes through ``context.state``'s TensorBoard and W&B writers."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_step_end(self, context):
        step, loss = context.state.train_state.step, float(context.loss_dict["lm loss"])
        self.losses[step] = loss
        if context.state.tensorboard_logger is not None:
            context.state.tensorboard_logger.add_scalar("custom/lm loss", loss, step)
        if context.state.wandb_logger is not None:
            context.state.wandb_logger.log({"custom/lm loss": loss}, step=step)


def test_tensorboard_logger_of_the_config_receives_what_a_callback_writes(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = tiny_gpt_pretrain_config(train_iters=4)
    config.logger.tensorboard_dir = str(tmp_path / "tb")
    writer = LogsThroughTheStateWriters()
    pretrain(config, forward_step, callbacks=[writer])

    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {e.step: e.value for e in events.Scalars("custom/lm loss")}
    assert scalars == pytest.approx(writer.losses, rel=1e-6)
    assert sorted(scalars) == [0, 1, 2, 3]


def test_tensorboard_logger_of_a_native_config_writes_into_the_run_directory(tmp_path):
    seen: list[Any] = []
    manager = CallbackManager()
    manager.register(
        "on_train_start", lambda context: seen.append(context.state.tensorboard_logger)
    )
    pretrain(small_gpt_pretrain_config(), forward_step, callbacks=manager)
    pretrain(small_gpt_pretrain_config(), forward_step, callbacks=manager, out_dir=tmp_path)
    assert seen[0] is None  # no run directory, nowhere to write
    assert seen[1] is not None and seen[1].log_dir == str(tmp_path / "tb")
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_wandb_logger_of_the_config_logs_a_callbacks_rows_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from hookloop.callbacks.wandb_logger import offline_history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    config = tiny_gpt_pretrain_config(train_iters=3)
    config.logger.wandb_project = "hookloop-tests"
    config.logger.wandb_exp_name = "custom-callback"
    config.logger.wandb_save_dir = str(tmp_path / "wb")
    writer = LogsThroughTheStateWriters()
    pretrain(config, forward_step, callbacks=[writer])

    rows = offline_history(tmp_path / "wb" / "wandb", wait_s=30)
    assert {
        r["_step"]: r["custom/lm loss"] for r in rows if "custom/lm loss" in r
    } == pytest.approx(writer.losses)
    assert sorted(writer.losses) == [0, 1, 2]


def test_wandb_logger_needs_an_experiment_name_as_the_original_does():
    config = tiny_gpt_pretrain_config(train_iters=1)
    config.logger.wandb_project = "hookloop-tests"
    with pytest.raises(ValueError, match=r"logger\.wandb_exp_name is empty"):
        pretrain(config, forward_step, callbacks=[LogsThroughTheStateWriters()])


def test_the_docs_quick_start_runs_on_the_config_container(capsys):
    code = example(
        "megatron_bridge_callbacks",
        "import time",
        "pretrain(config, forward_step, callbacks=[MyCallback()])",
    )
    swapped = translated(code).replace(
        SMALL_GPT_IMPORT,
        f"from {MB}.recipes.gpt import tiny_gpt_pretrain_config as qwen25_500m_pretrain_config",
    )
    namespace = run(swapped)

    assert isinstance(namespace["config"], ConfigContainer)
    lines = printed(capsys)
    assert lines[0] == "Training started at step 0"
    for step, line in enumerate(lines[1:5]):  # Megatron-Bridge: the first step reads 0
        assert re.fullmatch(rf"Step {step}: loss={LOSS_DICT}", line), line
    assert re.fullmatch(r"Training completed in \d+\.\d\ds", lines[5])


def test_megatron_bridge_shaped_config_fields_drive_the_run(tmp_path):
    # Code in the shape Megatron-Bridge users write: fields set on the container's sections.
    config = tiny_gpt_pretrain_config()
    config.train.train_iters = 6
    config.train.global_batch_size = 8
    config.train.micro_batch_size = 2  # 4 micro-batches accumulated per step
    config.optimizer.lr = 1e-3
    config.optimizer.min_lr = 1e-4
    config.checkpoint.save_interval = 3
    config.checkpoint.save = str(tmp_path / "run")
    seen: dict[str, Any] = {}

    def step_func(global_state, data_iterator, model):
        seen["cfg"] = global_state.cfg
        return forward_step(global_state, data_iterator, model)

    class Reads(Callback):
        def on_train_step_end(self, context):
            seen["lr"] = context.optimizer.param_groups[0]["lr"]
            seen["samples"] = context.state.train_state.consumed_train_samples
            seen["iters"] = context.state.cfg.train.train_iters

    result = pretrain(config, step_func, callbacks=[Reads()])

    assert seen["cfg"] is config and seen["iters"] == 6
    # the last step's end: Megatron-Bridge counts its samples after it
    assert result.step == 6 and seen["samples"] == 5 * 8
    assert seen["lr"] == pytest.approx(1e-3)
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert saved == ["step-00000003", "step-00000006"]

    # load = save: a second pretrain continues the newest checkpoint there
    config.train.train_iters = 8
    config.checkpoint.load = config.checkpoint.save
    recorder = FieldRecorder()
    assert pretrain(config, forward_step, callbacks=[recorder]).step == 8
    assert recorder.rows[0][:2] == ("on_data_init_start", 6)


def test_finetune_from_the_container_starts_from_its_pretrained_checkpoint(tmp_path):
    pretrained = tiny_gpt_pretrain_config(train_iters=3, save=str(tmp_path / "pre"))
    ended: list[float] = []
    manager = CallbackManager()
    _weights_at(manager, "on_train_end", ended)
    pretrain(pretrained, forward_step, callbacks=manager)

    config = tiny_gpt_pretrain_config(train_iters=2)
    config.checkpoint.pretrained_checkpoint = str(
        tmp_path / "pre" / "checkpoints" / "step-00000003"
    )
    started: list[float] = []
    manager = CallbackManager()
    _weights_at(manager, "on_train_start", started)
    finetune(config, forward_step, callbacks=manager)
    assert started == pytest.approx(ended, rel=1e-6)

    # Megatron-Bridge asserts: an AssertionError naming the two fields
    with pytest.raises(AssertionError, match=r"config\.checkpoint\.pretrained_checkpoint"):
        finetune(tiny_gpt_pretrain_config(), forward_step)


@pytest.mark.parametrize(
    ("section", "field", "value", "message"),
    [
        ("train", "global_batch_size", 6, r"global_batch_size \(6\) must be a multiple of"),
        ("train", "train_iters", 0, r"train\.train_iters must be an int >= 1, got 0"),
        ("optimizer", "lr", -1.0, r"optimizer\.lr must be a number > 0"),
        ("optimizer", "optimizer", "lion", r"optimizer\.optimizer must be 'adam' or 'sgd'"),
        ("scheduler", "lr_decay_style", "wsd", r"lr_decay_style must be 'constant', 'cosine'"),
        ("dataset", "split", "90,10", r"dataset\.split must be three comma-separated weights"),
        ("checkpoint", "save_interval", 0, r"checkpoint\.save_interval must be an int >= 1"),
        ("checkpoint", "load", "/elsewhere", r"checkpoint\.load .* differs from checkpoint\.save"),
    ],
)
def test_container_fields_are_validated_with_the_allowed_values(section, field, value, message):
    config = tiny_gpt_pretrain_config(save="/tmp/unused-run-dir")
    setattr(getattr(config, section), field, value)
    with pytest.raises(ValueError, match=message):
        pretrain(config, forward_step)


def test_pretrain_logs_losses_and_evaluations_through_the_config_writers(tmp_path):
    # as in Megatron-Bridge: the loop logs the loss components to TensorBoard (Megatron's tags)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = tiny_gpt_pretrain_config(train_iters=4, eval_interval=2)
    config.logger.tensorboard_dir = str(tmp_path / "tb")
    logged: dict[int, float] = {}
    manager = CallbackManager()

    def keep(ctx) -> None:
        logged[ctx.state.step] = ctx.logs["lm loss"]

    manager.native.register("on_log", keep)
    result = pretrain(config, forward_step, callbacks=manager)

    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "lm loss validation", "lm loss test"} <= tags
    # Megatron-Bridge's training-log tags, each also against the consumed samples
    for tag in ("learning-rate", "batch-size", "lm loss", "grad-norm", "lm loss validation"):
        assert {tag, f"{tag} vs samples"} <= tags, tag
    assert {e.step: e.value for e in events.Scalars("lm loss")} == pytest.approx(logged)
    assert {e.step: e.value for e in events.Scalars("lm loss vs samples")} == pytest.approx(
        {8 * step: loss for step, loss in logged.items()}
    )
    assert {e.value for e in events.Scalars("batch-size")} == {8.0}
    assert [e.step for e in events.Scalars("lm loss validation")] == [2, 4, 4]
    [test] = events.Scalars("lm loss test")
    assert (test.step, test.value) == (4, pytest.approx(result.metrics["test_lm loss"]))


# -- logger.log_progress: Megatron-Bridge's progress.txt --------------------------------

PROGRESS_SAVE = (
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\tJob ID: \t# GPUs: 1\tSaved checkpoint\tIteration: (\d+)\t"
    r"Job throughput: \d+\.\d MODEL_TFLOP/s/GPU\tCumulative throughput: \d+\.\d MODEL_TFLOP/s/GPU"
    r"\tFloating-point operations: (\d\.\d\de[+-]\d\d)\tTokens \(in billions\): (\d+\.\d\d)"
)


def test_log_progress_writes_megatron_bridges_lines_across_an_exit_and_a_resume(
    tmp_path, monkeypatch
):
    from hookloop.callbacks.progress_log import first_job_start

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    config = tiny_gpt_pretrain_config(
        train_iters=4, eval_interval=None, save_interval=2, save=str(tmp_path)
    )
    config.logger.log_progress = True
    config.train.exit_interval = 2
    with pytest.raises(SystemExit):
        pretrain(config, forward_step)
    config.train.exit_interval = None
    config.checkpoint.load = config.checkpoint.save
    pretrain(config, forward_step)

    lines = (tmp_path / "progress.txt").read_text().splitlines()
    assert [line.split("\t")[3] for line in lines] == [
        "Starting job",
        "Saved checkpoint",
        "Starting job",
        "Saved checkpoint",
    ]
    saves = [re.fullmatch(PROGRESS_SAVE, line) for line in lines[1::2]]
    assert all(saves), lines
    assert [int(m.group(1)) for m in saves] == [2, 4]  # type: ignore[union-attr]
    # Megatron-Bridge counts tokens as samples x seq_length: 8 x 32 a step
    assert [m.group(3) for m in saves] == ["0.00", "0.00"]  # type: ignore[union-attr]
    # the reader Megatron's own follows: the first job's start, no FLOPs before it
    start = first_job_start(tmp_path / "progress.txt", 1)
    assert start is not None and start.flops == 0.0
    assert start.time.strftime("%Y-%m-%d %H:%M:%S") == lines[0].split("\t")[0]
