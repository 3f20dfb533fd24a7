"""CallbackManager: registration checks, ordering, filters, dispatch and its costs."""

from __future__ import annotations

import io
import sys

import pytest

import hookloop.loop.parts as parts_module
from hookloop import Callback, CallbackContext, CallbackManager
from hookloop.events import EVENT_NAMES
from hookloop.testing import RecordingCallback


class LogsTo(Callback):
    """Appends its tag to a shared list on on_train_start."""

    def __init__(self, tag: str, out: list[str], priority: int = 50) -> None:
        self.tag = tag
        self.out = out
        self.priority = priority

    def on_train_start(self, ctx):
        self.out.append(self.tag)


class OnlyLog(Callback):
    def __init__(self) -> None:
        self.calls = 0

    def on_log(self, ctx):
        self.calls += 1


class Counter(Callback):
    """A stateful callback (state_dict / load_state_dict)."""

    def __init__(self, label: str | None = None) -> None:
        self.label = label
        self.n = 0

    @property
    def name(self) -> str:
        return f"Counter[{self.label}]" if self.label else "Counter"

    def on_train_step_end(self, ctx):
        self.n += 1

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def _tagger(tag: str, out: list[str]):
    def handler(ctx):
        out.append(tag)

    handler.__qualname__ = tag
    return handler


# -- ordering ------------------------------------------------------------------------------


def test_handlers_run_by_priority_then_registration_order_across_add_and_register():
    out: list[str] = []
    manager = CallbackManager()
    manager.add(LogsTo("cb-50-first", out))
    manager.register("on_train_start", _tagger("fn-50-second", out))
    manager.add(LogsTo("cb-10", out, priority=10))
    manager.register("on_train_start", _tagger("fn-10", out), priority=10)
    manager.add(LogsTo("cb-50-third", out))
    manager.register("on_train_start", _tagger("fn-minus-5", out), priority=-5)

    manager.fire("on_train_start", CallbackContext())

    assert out == ["fn-minus-5", "cb-10", "fn-10", "cb-50-first", "fn-50-second", "cb-50-third"]


def test_list_callbacks_gives_owners_in_execution_order():
    out: list[str] = []
    late, early = LogsTo("late", out, priority=60), LogsTo("early", out, priority=5)
    fn = _tagger("fn", out)
    manager = CallbackManager([late, early])
    manager.register("on_train_start", fn, priority=50)

    owners = manager.list_callbacks("on_train_start")

    assert owners == [early, fn, late]
    assert manager.list_callbacks("on_log") == []
    assert manager.callbacks == [late, early]  # instances in the order they were added


def test_index_is_rebuilt_only_when_callbacks_change(monkeypatch):
    rebuilds = []
    original = CallbackManager._rebuild

    def counting(self):
        rebuilds.append(1)
        original(self)

    monkeypatch.setattr(CallbackManager, "_rebuild", counting)
    manager = CallbackManager()
    index = manager.index
    log_cb = OnlyLog()
    manager.add(log_cb)
    fn = manager.register("on_train_start", lambda ctx: None)
    assert len(rebuilds) == 2

    ctx = CallbackContext()
    for _ in range(5):
        manager.fire("on_log", ctx)
        manager.fire("on_train_end", ctx)
        manager.has_callbacks("on_log")
        manager.list_callbacks("on_log")
    manager.describe_events(file=io.StringIO())
    assert len(rebuilds) == 2
    assert log_cb.calls == 5

    manager.remove(fn)
    assert len(rebuilds) == 3
    assert manager.index is index  # updated in place: holders of the dict see changes
    assert manager.index["on_log"] and not manager.index["on_train_start"]


def test_a_training_run_never_rebuilds_the_index(monkeypatch, make_trainer):
    manager = CallbackManager([OnlyLog(), RecordingCallback()])
    trainer = make_trainer(manager, eval_n=4, max_steps=4, log_every=1, eval_every=2)
    rebuilds = []
    monkeypatch.setattr(CallbackManager, "_rebuild", lambda self: rebuilds.append(1))
    trainer.train()
    assert rebuilds == []
    assert trainer.callbacks.index is manager.index


def test_base_class_no_ops_are_never_indexed():
    manager = CallbackManager(OnlyLog())
    handled = {event for event, handlers in manager.index.items() if handlers}
    assert handled == {"on_log"}
    assert set(manager.index) == set(EVENT_NAMES)
    assert manager.has_callbacks("on_log")
    assert not manager.has_callbacks("on_train_start")


def test_override_inherited_from_a_parent_class_is_indexed():
    class Child(OnlyLog):
        pass

    manager = CallbackManager(Child())
    assert manager.has_callbacks("on_log")
    assert sum(bool(h) for h in manager.index.values()) == 1


def test_an_instance_can_leave_out_one_of_its_classes_handlers():
    class TwoEvents(Callback):
        def __init__(self, per_step: bool) -> None:
            self.seen: list[str] = []
            if not per_step:
                self.on_train_step_end = None  # type: ignore[assignment]

        def on_train_step_end(self, ctx):
            self.seen.append("step")

        def on_log(self, ctx):
            self.seen.append("log")

    lean, full = TwoEvents(per_step=False), TwoEvents(per_step=True)
    manager = CallbackManager([lean, full])
    assert manager.list_callbacks("on_train_step_end") == [full]
    assert manager.list_callbacks("on_log") == [lean, full]
    for event in ("on_train_step_end", "on_log"):
        manager.fire(event, CallbackContext())
    assert (lean.seen, full.seen) == (["log"], ["step", "log"])


def test_builtins_keep_per_step_handlers_only_where_they_use_them():
    from hookloop.callbacks import DefaultMetrics, DivergenceDetector

    manager = CallbackManager([DefaultMetrics(), DivergenceDetector()])
    assert not manager.has_callbacks("on_train_step_start")
    assert not manager.has_callbacks("on_train_step_end")
    mfu, rewinding = DefaultMetrics(peak_flops=1e12), DivergenceDetector(action="rewind")
    manager = CallbackManager([mfu, rewinding])
    assert manager.list_callbacks("on_train_step_start") == [mfu]
    assert manager.list_callbacks("on_train_step_end") == [mfu, rewinding]


def test_events_is_the_frozenset_of_every_event_name():
    events = CallbackManager().events
    assert isinstance(events, frozenset)
    assert events == frozenset(EVENT_NAMES)


def test_firing_an_unhandled_event_calls_no_python_function():
    manager = CallbackManager(OnlyLog())
    ctx = CallbackContext()
    called: list[str] = []

    def profiler(frame, event, arg):
        if event == "call":
            called.append(frame.f_code.co_name)

    sys.setprofile(profiler)
    try:
        manager.fire("on_train_step_end", ctx)
        manager.fire("on_log", ctx)
    finally:
        sys.setprofile(None)

    # fire itself for both events, the one on_log handler, nothing for the unhandled event
    assert called == ["fire", "fire", "on_log"]


def test_a_handler_that_changes_the_callbacks_changes_the_dispatch_it_runs_in():
    # As transformers' CallbackHandler: an added handler runs in this same dispatch, a removed
    # one that has not run yet does not, and handlers already run do not run twice.
    manager, ran = CallbackManager(), []

    def later(ctx):
        ran.append("later")

    def added(ctx):
        ran.append("added")
        if chained not in manager.list_callbacks("on_log"):  # an edit in an edited dispatch
            manager.register("on_log", chained, priority=40)

    def chained(ctx):
        ran.append("chained")

    def editor(ctx):
        ran.append("editor")
        if not manager.list_callbacks("on_log").count(added):  # the first dispatch only
            manager.remove(later)
            manager.register("on_log", added, priority=30)

    manager.register("on_log", lambda ctx: ran.append("first"), priority=10)
    manager.register("on_log", editor, priority=20)
    manager.register("on_log", later, priority=25)
    manager.fire("on_log", CallbackContext())
    assert ran == ["first", "editor", "added", "chained"]
    ran.clear()
    manager.fire("on_log", CallbackContext())  # the next dispatch runs the list as it is now
    assert ran == ["first", "editor", "added", "chained"]


def test_a_failure_after_an_edit_in_the_dispatch_is_attributed_to_its_callback():
    manager = CallbackManager()

    def broken(ctx):
        raise RuntimeError("boom")

    manager.register("on_log", lambda ctx: manager.register("on_log", broken, priority=90))
    with pytest.raises(RuntimeError) as info:
        manager.fire("on_log", CallbackContext())
    assert info.value.__notes__ == [
        "hookloop: raised by callback "
        "'test_a_failure_after_an_edit_in_the_dispatch_is_attributed_to_its_callback.<locals>"
        ".broken' during event 'on_log'"
    ]


def test_an_edit_leaves_the_lists_of_events_it_did_not_change_alone():
    manager = CallbackManager(OnlyLog())
    before = manager.index["on_log"]
    manager.register("on_train_start", lambda ctx: None)
    assert manager.index["on_log"] is before and before.retired is None


# -- registration errors -------------------------------------------------------------------


def test_remove_a_callback_and_a_function():
    out: list[str] = []
    cb = LogsTo("cb", out)
    fn = _tagger("fn", out)
    manager = CallbackManager(cb)
    manager.register("on_train_start", fn)
    manager.register("on_train_end", fn)

    manager.remove(cb)
    manager.fire("on_train_start", CallbackContext())
    assert out == ["fn"]
    assert manager.callbacks == []

    manager.remove(fn)  # every registration of the function goes
    assert not manager.has_callbacks("on_train_start")
    assert not manager.has_callbacks("on_train_end")
    assert len(manager) == 0


def test_removing_something_not_registered_raises():
    manager = CallbackManager(OnlyLog())
    with pytest.raises(ValueError, match="not registered"):
        manager.remove(OnlyLog())
    with pytest.raises(ValueError, match="not registered"):
        manager.remove(print)


def test_a_callback_without_handlers_can_still_be_removed():
    quiet = Callback()
    manager = CallbackManager(quiet)
    assert manager.callbacks == [quiet]
    manager.remove(quiet)
    assert manager.callbacks == []


def test_adding_the_same_instance_twice_raises():
    cb = OnlyLog()
    manager = CallbackManager(cb)
    with pytest.raises(ValueError, match="already registered"):
        manager.add(cb)
    with pytest.raises(ValueError, match="already registered"):
        CallbackManager([OnlyLog(), cb, cb])
    assert len(manager.index["on_log"]) == 1


def test_adding_a_class_instead_of_an_instance_shows_how_to_instantiate():
    with pytest.raises(TypeError, match=r"OnlyLog\(\)"):
        CallbackManager().add(OnlyLog)


def test_adding_a_plain_function_points_to_register():
    with pytest.raises(TypeError, match="register"):
        CallbackManager().add(lambda ctx: None)


def test_misspelt_hook_method_is_rejected_when_added():
    class Typo(Callback):
        def on_trian_end(self, ctx):
            pass

    with pytest.raises(ValueError) as info:
        CallbackManager().add(Typo())
    assert "on_trian_end" in str(info.value)
    assert "Did you mean 'on_train_end'" in str(info.value)
    assert "Typo" in str(info.value)


def test_unknown_event_in_register_and_fire_suggests_the_right_name():
    manager = CallbackManager()
    with pytest.raises(ValueError, match="Did you mean 'on_train_start'"):
        manager.register("on_trian_start", lambda ctx: None)
    with pytest.raises(ValueError, match="Did you mean 'on_eval_end'"):
        manager.fire("on_evl_end", CallbackContext())
    with pytest.raises(ValueError, match="Valid events"):
        manager.has_callbacks("log")


def test_register_needs_a_callable():
    with pytest.raises(TypeError, match="callable"):
        CallbackManager().register("on_log", "print")


@pytest.mark.parametrize("priority", ["10", True, 1.5, None])
def test_invalid_priority_in_register_names_priority(priority):
    with pytest.raises(ValueError, match="priority"):
        CallbackManager().register("on_log", lambda ctx: None, priority=priority)


@pytest.mark.parametrize("priority", ["high", False])
def test_invalid_priority_on_a_callback_names_priority(priority):
    cb = OnlyLog()
    cb.priority = priority
    with pytest.raises(ValueError, match=r"OnlyLog\.priority"):
        CallbackManager().add(cb)


def test_two_stateful_callbacks_with_the_same_name_are_refused():
    manager = CallbackManager(Counter())
    with pytest.raises(ValueError, match="distinct names"):
        manager.add(Counter())


def test_stateful_callbacks_with_distinct_names_are_fine():
    manager = CallbackManager([Counter("a"), Counter("b")])
    assert set(manager.stateful_callbacks()) == {"Counter[a]", "Counter[b]"}


def test_non_stateful_callbacks_may_share_a_name():
    manager = CallbackManager([OnlyLog(), OnlyLog()])
    assert len(manager.index["on_log"]) == 2
    assert manager.stateful_callbacks() == {}


def test_required_callback_missing_is_reported_when_the_trainer_is_built(make_trainer):
    class NeedsCounter(Callback):
        requires = ("Counter",)

        def on_log(self, ctx):
            pass

    with pytest.raises(ValueError, match="requires 'Counter'"):
        make_trainer([NeedsCounter()], max_steps=1)
    make_trainer([NeedsCounter(), Counter()], max_steps=1)  # satisfied: builds


def test_register_works_as_a_decorator():
    manager = CallbackManager()

    @manager.register("on_train_start")
    def started(ctx):
        pass

    assert manager.list_callbacks("on_train_start") == [started]


# -- filters -------------------------------------------------------------------------------


def _steps_seen(make_trainer, max_steps=10, **filters) -> list[int]:
    seen: list[int] = []
    manager = CallbackManager()
    manager.register("on_train_step_end", lambda ctx: seen.append(ctx.state.step), **filters)
    make_trainer(manager, max_steps=max_steps).train()
    return seen


def test_every_n_runs_on_steps_n_2n_3n(make_trainer):
    assert _steps_seen(make_trainer, every=3) == [3, 6, 9]


def test_once_true_runs_only_on_the_first_step(make_trainer):
    assert _steps_seen(make_trainer, once=True) == [1]


def test_once_n_runs_only_at_step_n(make_trainer):
    assert _steps_seen(make_trainer, once=3) == [3]


def test_when_predicate_decides(make_trainer):
    assert _steps_seen(make_trainer, when=lambda ctx: ctx.state.step % 4 == 1) == [1, 5, 9]


def test_every_and_when_combine(make_trainer):
    assert _steps_seen(make_trainer, every=2, when=lambda ctx: ctx.state.step > 5) == [6, 8, 10]


def test_filters_on_add_apply_to_every_handler_of_the_callback(make_trainer):
    class TwoHooks(Callback):
        def __init__(self):
            self.seen = []

        def on_train_step_start(self, ctx):
            self.seen.append(("start", ctx.state.step))

        def on_train_step_end(self, ctx):
            self.seen.append(("end", ctx.state.step))

    cb = TwoHooks()
    make_trainer(CallbackManager().add(cb, every=4), max_steps=9).train()
    assert cb.seen == [("start", 4), ("end", 4), ("start", 8), ("end", 8)]


def test_every_on_epoch_events_counts_epochs(make_trainer):
    epochs: list[int] = []
    manager = CallbackManager()
    manager.register("on_epoch_end", lambda ctx: epochs.append(ctx.state.epoch + 1), every=2)
    make_trainer(manager, max_epochs=5).train()  # 16 samples, batch 4: 4 steps an epoch
    assert epochs == [2, 4]


def test_every_on_other_events_counts_firings(make_trainer):
    steps: list[int] = []
    manager = CallbackManager()
    manager.register("on_eval_end", lambda ctx: steps.append(ctx.state.step), every=2)
    manager.register("on_eval_end", lambda ctx: steps.append(-ctx.state.step), once=True)
    trainer = make_trainer(manager, eval_n=4, max_steps=6, eval_every=1, eval_at_epoch_end=False)
    trainer.train()
    assert steps == [-1, 2, 4, 6]


@pytest.mark.parametrize(
    ("filters", "name"),
    [
        ({"every": 0}, "every"),
        ({"every": -2}, "every"),
        ({"every": True}, "every"),
        ({"every": 2.0}, "every"),
        ({"once": 0}, "once"),
        ({"once": -1}, "once"),
        ({"once": "yes"}, "once"),
        ({"once": 1.5}, "once"),
        ({"when": True}, "when"),
        ({"when": "step > 3"}, "when"),
    ],
)
def test_invalid_filter_values_name_the_parameter(filters, name):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        CallbackManager().register("on_log", lambda ctx: None, **filters)
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        CallbackManager().add(OnlyLog(), **filters)


def test_once_false_does_not_silently_disable_the_handler(make_trainer):
    try:
        seen = _steps_seen(make_trainer, max_steps=3, once=False)
    except ValueError as err:  # refusing the value would be an acceptable fix too
        assert "once" in str(err)
        return
    assert seen == [1, 2, 3]


# -- errors in handlers --------------------------------------------------------------------


class Boom(Callback):
    def __init__(self, event_step: int = 2) -> None:
        self.event_step = event_step

    def on_train_step_end(self, ctx):
        if ctx.state.step == self.event_step:
            raise RuntimeError("boom")


def test_handler_error_propagates_with_a_note_after_on_exception_ran_once():
    seen: list[tuple[str, BaseException | None]] = []
    manager = CallbackManager(Boom(event_step=0))
    manager.register("on_exception", lambda ctx: seen.append(("on_exception", ctx.exception)))
    ctx = CallbackContext()

    with pytest.raises(RuntimeError, match="boom") as info:
        manager.fire("on_train_step_end", ctx)

    notes = getattr(info.value, "__notes__", [])
    assert any("Boom" in note and "on_train_step_end" in note for note in notes), notes
    assert seen == [("on_exception", info.value)]
    assert ctx.exception is None  # per-event field cleared again


def test_failing_on_exception_handler_is_noted_without_hiding_the_original():
    def broken(ctx):
        raise KeyError("also broken")

    manager = CallbackManager(Boom(event_step=0))
    manager.register("on_exception", broken)
    with pytest.raises(RuntimeError, match="boom") as info:
        manager.fire("on_train_step_end", CallbackContext())
    assert any("also failed" in note and "KeyError" in note for note in info.value.__notes__)


def test_handler_error_inside_training_fires_on_exception_once(make_trainer):
    rec = RecordingCallback(events=["on_train_step_start", "on_exception", "on_train_end"])
    with pytest.raises(RuntimeError, match="boom") as info:
        make_trainer([rec, Boom(event_step=2)], max_steps=5).train()
    assert rec.names().count("on_exception") == 1
    assert "on_train_end" not in rec.names()
    assert rec.events[-1] == ("on_exception", 2, 0)
    assert any("Boom" in n and "on_train_step_end" in n for n in info.value.__notes__)


def test_error_in_a_handler_during_evaluation_in_training_fires_on_exception_once(make_trainer):
    rec = RecordingCallback(events=["on_exception"])
    manager = CallbackManager(rec)

    def fail(ctx):
        raise ArithmeticError("eval handler")

    manager.register("on_eval_end", fail)
    with pytest.raises(ArithmeticError) as info:
        make_trainer(manager, eval_n=4, max_steps=4, eval_every=2).train()
    assert rec.events == [("on_exception", 2, 0)]
    assert sum("on_eval_end" in note for note in info.value.__notes__) == 1


def test_error_in_the_model_fires_on_exception_once_without_a_callback_note(make_trainer):
    import torch

    class Exploding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4, 1))

        def forward(self, x):
            raise OverflowError("model failed")

    rec = RecordingCallback(events=["on_exception"])
    with pytest.raises(OverflowError) as info:
        make_trainer([rec], model=Exploding(), max_steps=2).train()
    assert rec.names() == ["on_exception"]
    assert not any("hookloop" in n for n in getattr(info.value, "__notes__", []))


# -- introspection and sharing -------------------------------------------------------------


def test_describe_events_lists_handled_events_with_handlers_in_order(capsys):
    out: list[str] = []
    manager = CallbackManager([LogsTo("x", out, priority=70), OnlyLog()])
    manager.register("on_train_start", _tagger("early_fn", out), priority=5)

    text = manager.describe_events()

    assert capsys.readouterr().out.strip() == text.strip()
    lines = text.splitlines()
    assert lines == [
        "on_train_start",
        "       5  early_fn",
        "      70  LogsTo",
        "on_log",
        "      50  OnlyLog",
    ]


def test_describe_events_without_handlers_says_so(capsys):
    assert CallbackManager().describe_events() == "(no handlers registered)"
    full = CallbackManager().describe_events(only_handled=False)
    assert full.splitlines() == list(EVENT_NAMES)
    capsys.readouterr()


def test_user_state_is_shared_between_callbacks(make_trainer):
    class Writer(Callback):
        def on_train_start(self, ctx):
            ctx.user_state["seen_steps"] = []

        def on_train_step_end(self, ctx):
            ctx.user_state["seen_steps"].append(ctx.state.step)

    class Reader(Callback):
        def on_train_end(self, ctx):
            self.result = list(ctx.user_state["seen_steps"])

    reader = Reader()
    manager = CallbackManager([reader, Writer()])
    trainer = make_trainer(manager, max_steps=3)
    trainer.train()
    assert reader.result == [1, 2, 3]
    assert trainer.ctx.user_state is manager.user_state


# -- zero cost in the Trainer --------------------------------------------------------------


def test_trainer_fires_only_events_that_have_handlers(make_trainer):
    class StepEnd(Callback):
        def on_train_step_end(self, ctx):
            pass

    manager = CallbackManager(StepEnd())
    fired: list[str] = []
    original = manager.fire

    def spy(event, ctx):
        fired.append(event)
        original(event, ctx)

    manager.fire = spy  # the Trainer calls manager.fire for every dispatch
    trainer = make_trainer(manager, eval_n=4, test_n=4, max_steps=5, log_every=1, eval_every=2)
    trainer.train()
    trainer.test()
    assert set(fired) == {"on_train_step_end"}
    assert len(fired) == 5


def _spy_context(monkeypatch) -> list[str]:
    """Replace the Trainer's context class with one that records non-None writes."""
    writes: list[str] = []

    class SpyContext(CallbackContext):
        def __setattr__(self, name, value):
            if value is not None:
                writes.append(name)
            super().__setattr__(name, value)

    monkeypatch.setattr(parts_module, "CallbackContext", SpyContext)
    return writes


def test_micro_step_payload_is_not_built_without_a_micro_step_end_handler(
    monkeypatch, make_trainer
):
    writes = _spy_context(monkeypatch)
    manager = CallbackManager()
    manager.register("on_before_optimizer_step", lambda ctx: None)
    make_trainer(manager, max_steps=3, grad_accum=2, n=32).train()
    assert "outputs" not in writes
    assert "loss" not in writes
    assert "loss_dict" in writes  # the handled event did get its payload


def test_micro_step_payload_is_built_when_someone_listens(monkeypatch, make_trainer):
    writes = _spy_context(monkeypatch)
    outputs = []
    manager = CallbackManager()
    manager.register("on_micro_step_end", lambda ctx: outputs.append(ctx.outputs.shape))
    make_trainer(manager, max_steps=2).train()
    assert "outputs" in writes
    assert outputs == [(4, 1), (4, 1)]


def test_logs_stay_none_without_log_handlers(monkeypatch, make_trainer):
    writes = _spy_context(monkeypatch)
    seen = []
    manager = CallbackManager()
    manager.register("on_train_step_end", lambda ctx: seen.append(ctx.logs))
    trainer = make_trainer(manager, max_steps=4, log_every=1)
    result = trainer.train()
    assert "logs" not in writes
    assert seen == [None] * 4
    assert "loss" in result.logs  # logging still happened for the result


def test_logs_are_set_for_log_handlers(monkeypatch, make_trainer):
    writes = _spy_context(monkeypatch)
    steps = []
    manager = CallbackManager()
    manager.register("on_log", lambda ctx: steps.append((ctx.state.step, "loss" in ctx.logs)))
    make_trainer(manager, max_steps=4, log_every=2).train()
    assert "logs" in writes
    assert steps == [(2, True), (4, True)]


def test_filters_given_to_add_never_skip_set_up_and_tear_down_events():
    from hookloop import TrainConfig, Trainer
    from hookloop.testing import TinyModel, ToyData

    rec = RecordingCallback(events=["on_train_start", "on_train_step_end", "on_train_end"])
    manager = CallbackManager()
    manager.add(rec, every=3)
    Trainer(TinyModel(), train_data=ToyData(n=32), loss_fn=TinyModel.loss_fn,
            config=TrainConfig(max_steps=7, log_every=0), callbacks=manager).train()  # fmt: skip
    assert rec.events == [
        ("on_train_start", 0, 0),
        ("on_train_step_end", 3, 0),
        ("on_train_step_end", 6, 0),
        ("on_train_end", 7, 0),
    ]
