"""``hookloop tune`` with several objectives (a Pareto front, its plot and configs) and
with constraints (infeasible trials are recorded as Optuna's samplers read them and are
never chosen as best); each bad setting is refused in one line naming what is allowed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import hookloop.tune
from hookloop.app.cli import main
from hookloop.recipes import mlp
from hookloop.tune.space import apply_params
from test_tune import FAST

optuna = pytest.importorskip("optuna")

SPACE = {
    "optimizer.lr": {"low": 1.0e-3, "high": 0.3, "log": True},
    "model.hidden": {"low": 4, "high": 64},
}


def _space(tmp_path: Path, space: dict | None = None) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space or SPACE, sort_keys=False))
    return path


def _tune(study: Path, space: Path, trials: int, *extra: str) -> int:
    argv = ["tune", "--recipe", "mlp-regression", "--space", str(space)]
    return main([*argv, "--trials", str(trials), "--out", str(study), *extra, *FAST])


def _load(study: Path) -> optuna.Study:
    return optuna.load_study(study_name="hookloop", storage=f"sqlite:///{study / 'study.db'}")


def _param_count(hidden: int) -> int:
    cfg = apply_params(mlp.default_config(), {"model.hidden": hidden})
    return sum(p.numel() for p in mlp.make_mlp(cfg.model).parameters())


def test_two_metrics_give_a_pareto_front_its_plot_and_a_config_per_front_trial(tmp_path, capsys):
    study_dir = tmp_path / "study"
    extra = ["--metric", "eval_loss,param_count", "--sampler", "nsga2"]
    extra += ["--sampler-args", "{population_size: 4}", "--constraint", "param_count <= 1500"]
    assert _tune(study_dir, _space(tmp_path), 6, *extra) == 0
    out = capsys.readouterr().out

    study = _load(study_dir)
    assert [d.name for d in study.directions] == ["MINIMIZE", "MINIMIZE"]
    done = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert len(done) == 6
    for t in done:  # each objective: eval_loss's best evaluation, and the model's size
        assert t.values[1] == _param_count(t.params["model.hidden"])
        evals = [
            r["eval_loss"]
            for r in map(json.loads, (study_dir / f"trial-{t.number:04d}" / "metrics.jsonl").open())
            if r.get("kind") == "eval"
        ]
        assert t.values[0] == pytest.approx(min(evals))
        assert t.user_attrs["constraint"] == [t.values[1] - 1500]
    front = {t.number for t in study.best_trials}
    feasible = [t for t in done if t.values[1] <= 1500]
    assert front and all(study.trials[n].values[1] <= 1500 for n in front)
    for t in feasible:  # the front: the feasible trials no feasible trial dominates
        dominated = any(
            o.values[0] <= t.values[0] and o.values[1] <= t.values[1] and o.values != t.values
            for o in feasible
        )
        assert (t.number in front) == (not dominated)

    # the printed table lists exactly the front, by eval_loss
    assert "Pareto front (" in out and "eval_loss (minimize), param_count (minimize)" in out
    table = out.split("Pareto front", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    listed = [int(line.split()[0]) for line in table]
    assert set(listed) == front
    assert listed == sorted(front, key=lambda n: study.trials[n].values[0])
    # one config per front trial; best_config.yaml is the front's best eval_loss
    pareto = sorted(p.name for p in (study_dir / "pareto").iterdir())
    assert pareto == [f"trial-{n:04d}.yaml" for n in sorted(front)]
    best = yaml.safe_load((study_dir / "best_config.yaml").read_text())
    assert best["model"]["hidden"] == study.trials[listed[0]].params["model.hidden"]
    for n in front:
        cfg = yaml.safe_load((study_dir / "pareto" / f"trial-{n:04d}.yaml").read_text())
        assert cfg["model"]["hidden"] == study.trials[n].params["model.hidden"]
    # the plot: the Pareto front only (the one-objective plots are skipped)
    assert sorted(p.name for p in (study_dir / "plots").iterdir()) == ["pareto_front.png"]
    assert main(["plot", str(study_dir), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "pareto_front.png").stat().st_size > 10_000

    saved = yaml.safe_load((study_dir / "tune.yaml").read_text())
    assert saved["metric"] == ["eval_loss", "param_count"] and saved["pruner"] == "none"
    assert saved["constraints"] == ["param_count <= 1500"]


def test_a_trial_that_breaks_a_constraint_is_never_the_best(tmp_path, capsys):
    enqueue = tmp_path / "enqueue.yaml"  # the big model learns better but is too big
    enqueue.write_text(
        yaml.safe_dump(
            [
                {"model.hidden": 48, "optimizer.lr": 0.05},
                {"model.hidden": 6, "optimizer.lr": 0.002},
            ]
        )
    )
    study_dir = tmp_path / "study"
    extra = ["--enqueue", str(enqueue), "--constraint", "param_count <= 1000"]
    extra += ["--constraint", "eval_loss <= 100", "--pruner", "none"]
    assert _tune(study_dir, _space(tmp_path), 2, *extra) == 0
    out = capsys.readouterr().out
    study = _load(study_dir)
    big, small = study.trials
    assert big.params["model.hidden"] == 48 and big.value < small.value  # big would win
    last = {}
    for t in (big, small):  # the constraint values: param_count, and the last evaluation
        rows = (study_dir / f"trial-{t.number:04d}" / "metrics.jsonl").open()
        last[t.number] = [json.loads(r) for r in rows if '"eval"' in r][-1]["eval_loss"]
    assert big.user_attrs["constraint"] == [_param_count(48) - 1000, last[0] - 100]
    assert small.user_attrs["constraint"] == [_param_count(6) - 1000, last[1] - 100]
    if hasattr(optuna.trial.Trial, "set_constraint"):  # what Optuna's samplers read
        assert big.constraints == {
            "param_count <= 1000": _param_count(48) - 1000,
            "eval_loss <= 100": pytest.approx(last[0] - 100),
        }
        assert study.best_trial.number == small.number
    best = yaml.safe_load((study_dir / "best_config.yaml").read_text())
    assert best["model"]["hidden"] == 6
    table = out.split("\n\n")[0].splitlines()
    assert [line.split()[0] for line in table[1:]] == [str(small.number)]
    assert (
        f"  trial {big.number} infeasible: breaks param_count <= 1000 "
        f"(param_count off by {_param_count(48) - 1000})" in out
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--metric", "eval_loss,param_count", "--pruner", "median"],
            "--pruner median cannot be used with several --metric (eval_loss, param_count): "
            "Optuna cannot prune a multi-objective trial; give --pruner none",
        ),
        (
            ["--metric", "eval_loss", "--metric", "param_count", "--sampler", "cmaes"],
            "--sampler cmaes cannot optimise several --metric (eval_loss, param_count); "
            "allowed: tpe, random, grid, qmc, gp, nsga2",
        ),
        (
            ["--metric", "eval_loss,param_count", "--direction", "minimize,maximize,minimize"],
            "--direction must be one direction, or one per --metric (2: eval_loss, "
            "param_count), got ['minimize', 'maximize', 'minimize']",
        ),
        (
            ["--direction", "lower"],
            "--direction must be 'minimize' or 'maximize', got 'lower'",
        ),
        (
            ["--metric", "eval_loss,eval_loss"],
            "--metric names a metric twice: eval_loss, eval_loss",
        ),
        (
            ["--constraint", "param_count < 2e6"],
            "--constraint 'param_count < 2e6': write 'METRIC <= NUMBER' or 'METRIC >= NUMBER', "
            "e.g. 'param_count <= 2e6' (< and > are not allowed)",
        ),
        (
            ["--constraint", "param_count <= lots"],
            "--constraint 'param_count <= lots': the bound 'lots' is not a number",
        ),
        (
            ["--constraint", "<= 3"],
            "--constraint '<= 3': '' is not a metric name",
        ),
        (
            ["--sampler", "random", "--constraint", "param_count <= 2e6"],
            "--sampler random does not take constraints (--constraint 'param_count <= 2e6'); "
            "samplers that do: tpe, gp, nsga2",
        ),
    ],
)
def test_bad_objectives_and_constraints_are_refused_in_one_line(tmp_path, capsys, extra, message):
    study_dir = tmp_path / "study"
    assert _tune(study_dir, _space(tmp_path), 2, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not study_dir.exists()


def test_a_trial_missing_a_constrained_metric_fails_naming_it(tmp_path, capsys):
    study_dir = tmp_path / "study"
    extra = ["--constraint", "accuracy >= 0.9", "--pruner", "none", "--no-plots"]
    assert _tune(study_dir, _space(tmp_path), 1, *extra) == 1
    trial = _load(study_dir).trials[0]
    assert trial.state.name == "FAIL"
    assert trial.user_attrs["fail_reason"] == (
        "--constraint 'accuracy >= 0.9' names a metric the evaluations do not report "
        "(they report eval_loss, and param_count)"
    )


def test_the_python_api_takes_several_objectives(tmp_path):
    def objective(trial):
        x = trial.params["x"]
        return (x - 1.0) ** 2, x  # minimise the first, maximise x

    space = {"x": {"low": -3.0, "high": 3.0}}
    study = hookloop.tune.run(
        objective, space, trials=8, out=tmp_path / "fn", direction=["minimize", "maximize"]
    )
    assert [d.name for d in study.directions] == ["MINIMIZE", "MAXIMIZE"]
    assert len(study.trials) == 8 and all(len(t.values) == 2 for t in study.trials)

    # the front: the trials no other trial beats on both (lower first value, higher x)
    def beaten(t):
        return any(
            o.values[0] <= t.values[0] and o.values[1] >= t.values[1] and o.values != t.values
            for o in study.trials
        )

    assert {t.number for t in study.best_trials} == {
        t.number for t in study.trials if not beaten(t)
    }

    with pytest.raises(hookloop.tune.TuneError, match="1 trials failed"):
        hookloop.tune.run(
            lambda trial: 0.5, space, trials=1, out=tmp_path / "one", direction=["minimize"] * 2
        )
    (failed,) = optuna.load_study(
        study_name="hookloop", storage=f"sqlite:///{tmp_path / 'one' / 'study.db'}"
    ).trials
    assert failed.state.name == "FAIL"
    assert failed.user_attrs["fail_reason"] == "the objective returned 0.5, not 2 numbers"

    with pytest.raises(ValueError, match=r"^pruner 'median' cannot be used with several"):
        hookloop.tune.run(
            objective, space, trials=1, out=tmp_path / "p", direction=["minimize"] * 2,
            pruner="median",
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"--pruner median cannot be used with several --metric"):
        hookloop.tune.run(
            "mlp-regression", SPACE, trials=1, out=tmp_path / "r",
            metric=["eval_loss", "param_count"], pruner="median",
        )  # fmt: skip
    assert not (tmp_path / "r").exists()


def test_a_tune_yaml_with_an_unknown_key_is_one_line_naming_the_keys(tmp_path, capsys):
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    spec = {"recipe": "mlp-regression", "space": SPACE, "trials": 2}
    (study_dir / "tune.yaml").write_text(yaml.safe_dump({**spec, "constraint": ["x <= 1"]}))
    assert main(["plot", str(study_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tune.yaml: unknown key 'constraint'; allowed: recipe, space" in err[0]
    assert err[0].endswith("pruner_args, constraints")
