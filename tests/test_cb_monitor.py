"""MetricTracker: the shared "did it improve?" rule, with plain numbers."""

from __future__ import annotations

import math

import pytest

from hookloop.callbacks.monitor import MetricTracker


def _updates(tracker: MetricTracker, values: list[float]) -> list[bool]:
    return [tracker.update(v) for v in values]


def test_min_mode_counts_updates_without_improvement_and_resets_on_a_new_best():
    t = MetricTracker("min")
    assert _updates(t, [1.0, 0.9, 0.95, 0.9, 0.8]) == [True, True, False, False, True]
    assert t.best == 0.8
    assert t.bad_count == 0
    t.update(0.85)
    assert t.bad_count == 1
    assert t.updates == 6


def test_max_mode_prefers_larger_values():
    t = MetricTracker("max")
    assert _updates(t, [0.5, 0.6, 0.55, 0.7]) == [True, True, False, True]
    assert (t.best, t.bad_count) == (0.7, 0)


def test_absolute_min_delta_ignores_changes_not_larger_than_it():
    t = MetricTracker("min", min_delta=0.1)
    assert _updates(t, [1.0, 0.95, 0.9, 0.89]) == [True, False, False, True]
    assert t.bad_count == 0 and t.best == 0.89


def test_relative_min_delta_is_a_fraction_of_the_best_as_in_the_hpo_trainer():
    t = MetricTracker("min", min_delta=1e-4, threshold_mode="rel")  # 0.01 %
    t.update(100.0)
    assert not t.update(99.995)  # 0.005 % better: noise
    assert t.update(99.98)  # 0.02 % better
    up = MetricTracker("max", min_delta=0.5, threshold_mode="rel")
    up.update(-2.0)  # a negative best: the margin is 50 % of |best|
    assert not up.update(-1.5)
    assert up.update(-0.9)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_never_improve_and_count_as_bad(bad):
    t = MetricTracker("min")
    assert not t.update(bad)  # not even as the first value
    assert t.best is None
    t.update(1.0)
    assert not t.update(bad)
    assert (t.best, t.bad_count) == (1.0, 1)


def test_state_dict_round_trips_and_reset_forgets():
    t = MetricTracker("max", min_delta=0.01)
    _updates(t, [0.1, 0.3, 0.2, 0.25])
    clone = MetricTracker("max", min_delta=0.01)
    clone.load_state_dict(t.state_dict())
    assert clone.state_dict() == t.state_dict() == {"best": 0.3, "bad_count": 2, "updates": 4}
    assert clone.update(0.32) and not clone.update(0.325)
    t.reset()
    assert (t.best, t.bad_count, t.updates) == (None, 0, 0)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"mode": "minimum"}, "mode"),
        ({"min_delta": -0.1}, "min_delta"),
        ({"min_delta": math.inf}, "min_delta"),
        ({"min_delta": "0.1"}, "min_delta"),
        ({"threshold_mode": "percent"}, "threshold_mode"),
    ],
)
def test_bad_arguments_raise_naming_the_parameter(kwargs, named):
    with pytest.raises(ValueError, match=named):
        MetricTracker(**kwargs)
