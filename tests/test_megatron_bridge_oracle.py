"""The Megatron-Bridge dialect beside Megatron-Bridge itself.

The oracle is Megatron-Bridge's own ``training/callbacks.py`` (the 0.3.1 wheel, which
scripts/test.sh installs without its dependencies), loaded from its file: it needs only
the standard library. Each scenario runs through both modules and the outcomes are
compared: calls and their order, what the manager reports, contexts, errors. The
0.3.1 release predates ``on_data_init_start`` and ``on_checkpoint_save``; the dialect
follows the newer Megatron-Bridge there (the comparisons use 0.3.1's events).

The last tests run a whole ``pretrain()`` on the small CPU config, shaped as
Megatron-Bridge's end-to-end callback test (8 steps, validation every 5, a save at 7).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from types import ModuleType
from typing import Any

import pytest
import torch

from hookloop.compat.megatron_bridge.recipes import tiny_gpt_pretrain_config
from hookloop.compat.megatron_bridge.training import callbacks as ours
from hookloop.compat.megatron_bridge.training.gpt_step import forward_step
from hookloop.compat.megatron_bridge.training.pretrain import pretrain

NEWER_EVENTS = {"on_data_init_start", "on_checkpoint_save"}


def _load_oracle() -> ModuleType:
    try:
        dist = importlib.metadata.distribution("megatron-bridge")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megatron-bridge is not installed (scripts/test.sh installs it)")
    path = dist.locate_file("megatron/bridge/training/callbacks.py")
    name = "megatron_bridge_oracle_callbacks"
    spec = importlib.util.spec_from_file_location(name, str(path))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def upstream() -> ModuleType:
    return _load_oracle()


def _events(upstream: ModuleType) -> list[str]:
    return sorted(upstream.VALID_EVENTS)


def _context(module: ModuleType, **fields: Any) -> Any:
    return module.CallbackContext(state=object(), model=[torch.nn.Linear(1, 1)], **fields)


def _scenario(module: ModuleType) -> tuple[Any, list[tuple[str, str]]]:
    """A manager with classes, functions, a duck-typed object, one instance twice."""
    calls: list[tuple[str, str]] = []

    class Tracker(module.Callback):
        def __init__(self, name: str) -> None:
            self.name = name

        def on_train_start(self, context: Any) -> None:
            calls.append((self.name, "on_train_start"))

        def on_train_step_end(self, context: Any) -> None:
            calls.append((self.name, "on_train_step_end"))

        def on_eval_end(self, context: Any) -> None:
            calls.append((self.name, "on_eval_end"))

        def on_helper(self, context: Any) -> None:  # not an event: never called
            calls.append((self.name, "on_helper"))

    class DuckTyped:  # no base class, one event method
        def on_test_end(self, context: Any) -> None:
            calls.append(("duck", "on_test_end"))

    manager = module.CallbackManager()
    first = Tracker("first")
    manager.add(first)
    manager.register("on_train_start", lambda context: calls.append(("fn", "on_train_start")))
    manager.add([Tracker("second"), DuckTyped()])
    manager.add(first)  # the same instance again
    manager.register("on_train_end", lambda context: calls.append(("fn", "on_train_end")))
    return manager, calls


def test_the_same_registrations_fire_the_same_calls_in_the_same_order(upstream):
    outcomes = []
    for module in (upstream, ours):
        manager, calls = _scenario(module)
        for event in _events(upstream):
            manager.fire(event, _context(module))
        report = {
            e: (manager.has_callbacks(e), len(manager.list_callbacks(e))) for e in _events(upstream)
        }
        outcomes.append((calls, report))
    assert outcomes[0] == outcomes[1]
    assert ("first", "on_helper") not in outcomes[0][0]


def test_should_fire_and_has_callbacks_agree_on_known_and_unknown_names(upstream):
    answers = []
    for module in (upstream, ours):
        manager, _ = _scenario(module)
        names = [*_events(upstream), "on_nothing", "", "on_log"]
        answers.append(
            [module.should_fire(manager, n) for n in names]
            + [module.should_fire(None, n) for n in names]
            + [manager.has_callbacks(n) for n in names]
        )
    assert answers[0] == answers[1]


@pytest.mark.parametrize("method", ["register", "list_callbacks"])
def test_an_unknown_event_is_refused_with_megatron_bridges_message(upstream, method):
    messages = []
    for module in (upstream, ours):
        manager = module.CallbackManager()
        args = ("on_trian_start", print) if method == "register" else ("on_trian_start",)
        with pytest.raises(ValueError) as info:
            getattr(manager, method)(*args)
        messages.append(str(info.value))
    head = "Unknown event 'on_trian_start'. Valid events: frozenset({"
    assert messages[0].startswith(head) and messages[1].startswith(head)
    # ours: Megatron-Bridge's set (two newer events) and then the closest name
    assert messages[1].endswith("}) Did you mean 'on_train_start'?")


def _failing_manager(module: ModuleType, after: list[str]) -> Any:
    manager = module.CallbackManager()
    manager.register("on_eval_end", lambda context: after.append("before"))
    manager.register("on_eval_end", lambda context: {}["missing"])
    manager.register("on_eval_end", lambda context: after.append("after"))
    return manager


def test_an_exception_stops_the_event_and_reaches_the_caller_unchanged(upstream):
    results = []
    for module in (upstream, ours):
        after: list[str] = []
        with pytest.raises(KeyError) as info:
            _failing_manager(module, after).fire("on_eval_end", _context(module))
        results.append((after, info.value.args))
    assert results[0] == results[1] == (["before"], ("missing",))


def test_the_context_is_the_same_dataclass_with_hookloops_fields_after_its_own(upstream):
    import dataclasses

    theirs = [(f.name, f.default) for f in dataclasses.fields(upstream.CallbackContext)]
    mine = [(f.name, f.default) for f in dataclasses.fields(ours.CallbackContext)]
    assert mine[: len(theirs)] == theirs
    assert [name for name, _ in mine[len(theirs) :]] == ["non_loss_data", "checkpoint_path"]
    # positional construction and the user_state default behave alike
    for module in (upstream, ours):
        ctx = module.CallbackContext("state", ["chunk"])
        ctx.extra = "callbacks may hang their own attributes on it"
        assert (ctx.user_state, ctx.optimizer, ctx.grad_norm) == ({}, None, None)


def test_normalize_callbacks_returns_the_same_kinds(upstream):
    for module in (upstream, ours):
        manager = module.CallbackManager()
        assert module.normalize_callbacks(None) is None
        assert module.normalize_callbacks(manager) is manager
        made = module.normalize_callbacks([])
        assert isinstance(made, module.CallbackManager)
        assert not any(made.has_callbacks(e) for e in module.VALID_EVENTS)


def test_event_names_are_megatron_bridges_with_its_two_newer_events(upstream):
    assert ours.VALID_EVENTS == upstream.VALID_EVENTS | NEWER_EVENTS
    assert isinstance(ours.VALID_EVENTS, frozenset)
    hooks = {n for n in vars(ours.Callback) if n.startswith("on_")}
    assert hooks == set(ours.VALID_EVENTS)
    assert ours.CallbackManager().events == ours.VALID_EVENTS


# -- a whole run, shaped as Megatron-Bridge's end-to-end callback test ---------------------


class Tracking(ours.Callback):
    """Every event with what its context carries."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def _keep(self, event: str, context: ours.CallbackContext) -> None:
        self.rows.append(
            {
                "event": event,
                "step": context.state.train_state.step,
                "optimizer": context.optimizer is not None,
                "scheduler": context.scheduler is not None,
                "loss_dict": context.loss_dict,
                "grad_norm": context.grad_norm,
                "skipped_iter": context.skipped_iter,
                "total_loss_dict": context.total_loss_dict,
                "training": any(m.training for m in context.model),
                "user_state": context.user_state is not None,
            }
        )

    def count(self, event: str) -> int:
        return sum(row["event"] == event for row in self.rows)

    def of(self, event: str) -> list[dict[str, Any]]:
        return [row for row in self.rows if row["event"] == event]


def _keeper(event: str) -> Any:
    return lambda self, context: self._keep(event, context)


for _event in ours.EVENT_NAMES:
    setattr(Tracking, _event, _keeper(_event))
del _event


class Counter(ours.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.at_eval: list[int] = []
        self.at_test: list[int] = []
        self.final: int | None = None

    def on_train_start(self, context):
        context.user_state["counter"] = 0

    def on_train_step_end(self, context):
        context.user_state["counter"] += 1
        self.steps.append(context.user_state["counter"])

    def on_eval_start(self, context):
        self.at_eval.append(context.user_state.get("counter", -1))

    def on_test_start(self, context):
        self.at_test.append(context.user_state.get("counter", -1))

    def on_train_end(self, context):
        self.final = context.user_state.get("counter", -1)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_pretrain_run_fires_what_megatron_bridges_end_to_end_test_expects(tmp_path, async_save):
    iters, eval_interval, eval_iters = 8, 5, 2
    config = tiny_gpt_pretrain_config(
        train_iters=iters,
        eval_interval=eval_interval,
        eval_iters=eval_iters,
        save_interval=iters - 1,
        save=str(tmp_path),
    )
    config.checkpoint.async_save = async_save
    tracking, counter, functional = Tracking(), Counter(), []
    manager = ours.CallbackManager()
    manager.add([tracking, counter])
    manager.register("on_train_start", lambda context: functional.append("start"))
    manager.register("on_train_step_end", lambda context: functional.append("step"))
    manager.register("on_train_end", lambda context: functional.append("end"))

    pretrain(config, forward_step, callbacks=manager)

    evals = iters // eval_interval + 1  # in training, then once more after it
    expected_counts = {
        "on_train_start": 1,
        "on_train_end": 1,
        "on_train_step_start": iters,
        "on_train_step_end": iters,
        "on_checkpoint_save": 2,  # at step 7, and the last step at the end
        "on_eval_start": evals,
        "on_eval_end": evals,
        "on_eval_step_start": evals * eval_iters,
        "on_eval_step_end": evals * eval_iters,
        "on_test_start": 1,
        "on_test_end": 1,
        "on_test_step_start": eval_iters,
        "on_test_step_end": eval_iters,
    }
    assert {e: tracking.count(e) for e in expected_counts} == expected_counts
    events = [row["event"] for row in tracking.rows]
    assert events[1] == "on_train_start" and events[-1] == "on_test_end"
    assert events.index("on_train_end") < events.index("on_test_start")
    steps = [e for e in events if e.startswith("on_train_step")]
    assert steps == ["on_train_step_start", "on_train_step_end"] * iters
    assert all(row["user_state"] for row in tracking.rows)
    for row in tracking.rows:
        training = row["event"].startswith("on_train") or row["event"] == "on_data_init_start"
        if training:
            assert row["optimizer"] and row["scheduler"] and row["training"], row
        if row["event"].startswith(("on_eval", "on_test")):
            assert not row["optimizer"] and not row["scheduler"] and not row["training"], row
    for row in tracking.of("on_train_step_end"):
        assert set(row["loss_dict"]) == {"lm loss"}
        assert isinstance(row["grad_norm"], float) and row["skipped_iter"] is False
    for row in tracking.of("on_eval_end") + tracking.of("on_test_end"):
        assert set(row["total_loss_dict"]) == {"lm loss"}
    assert [row["step"] for row in tracking.of("on_train_step_start")] == list(range(iters))
    assert [row["step"] for row in tracking.of("on_checkpoint_save")] == [iters - 1, iters]
    assert counter.steps == list(range(1, iters + 1)) and counter.final == iters
    assert counter.at_eval == [eval_interval, iters] and counter.at_test == [iters]
    assert functional[0] == "start" and functional[-1] == "end"
    assert functional.count("step") == iters
