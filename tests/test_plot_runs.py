"""`hookloop plot` and `hookloop runs` on real and hand-written run directories."""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
from pathlib import Path

import pytest

from _quiet import NO_CONTROL, NO_TENSORBOARD
from hookloop import Config, Trainer
from hookloop.app.plot import add_plot_command, make_figure
from hookloop.app.runs import add_runs_command, summarize_run
from hookloop.callbacks import JsonLogger, read_jsonl
from hookloop.testing import TinyModel, ToyData

pytest.importorskip("matplotlib")


def command(add: object, argv: list[str]) -> int:
    """Parse ``argv`` with a parser holding only this command, and run it as the CLI would."""
    parser = argparse.ArgumentParser(prog="hookloop")
    add(parser.add_subparsers(dest="command"))  # type: ignore[operator]
    args = parser.parse_args(argv)
    return args.run(args)


def cli_train(out: Path, *overrides: str) -> None:
    from hookloop.app.cli import main

    code = main(["train", "--recipe", "mlp-regression", "--out", str(out),
                 "train.max_steps=40", "train.log_every=2", "train.eval_every=10",
                 "logging.progress=false", "logging.tensorboard=true", NO_CONTROL,
                 *overrides])  # fmt: skip
    assert code == 0


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    """Two short `hookloop train` runs of the MLP recipe with different learning rates.

    The first writes TensorBoard events (a test reads them back); the second needs none.
    """
    root = tmp_path_factory.mktemp("runs")
    cli_train(root / "lr-0.05")
    cli_train(root / "lr-0.01", "optimizer.lr=0.01", NO_TENSORBOARD)
    return root / "lr-0.05", root / "lr-0.01"


def write_log(run: Path, records: list[dict]) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def panel_titles(fig) -> list[str]:
    return [ax.get_title(loc="left") for ax in fig.axes if ax.get_title(loc="left")]


def legend_texts(fig) -> set[str]:
    return {t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().texts}


# -- hookloop plot ---------------------------------------------------------------------------


def test_plot_of_a_real_run_is_a_nontrivial_png_in_the_run_directory(two_runs, capsys):
    from matplotlib.image import imread

    run, _ = two_runs
    assert command(add_plot_command, ["plot", str(run)]) == 0

    png = run / "plots" / "metrics.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.stat().st_size > 30_000
    pixels = imread(png)[..., :3]
    assert pixels.shape[0] > 400 and pixels.shape[1] > 800
    assert pixels.std() > 0.08  # not a blank canvas
    assert (pixels.mean(axis=2) < 0.9).mean() > 0.03  # a fair share of drawn (non-white) pixels


def test_plot_shows_loss_learning_rate_and_throughput_and_skips_empty_panels(two_runs):
    fig = make_figure([two_runs[0]])

    titles = panel_titles(fig)
    assert titles[:2] == ["Loss", "Learning rate"] and "Throughput" in titles
    # The MLP recipe does not clip, so no gradient norm is logged: no empty panel for it.
    assert "Gradient norm" not in titles
    assert not any(ax.images for ax in fig.axes)  # no per-parameter norms logged: no heatmap
    assert {"train", "eval"} <= legend_texts(fig)
    assert fig.axes[0].get_yscale() == "linear"


def test_without_a_logged_throughput_steps_per_second_comes_from_timestamps(tmp_path):
    run = write_log(tmp_path / "run", [
        {"kind": "start", "time": 0.0, "step": 0},
        {"kind": "train", "time": 1.0, "step": 10, "loss": 1.0},
        {"kind": "train", "time": 2.0, "step": 20, "loss": 0.9},
        {"kind": "train", "time": 4.0, "step": 30, "loss": 0.8},
        {"kind": "start", "time": 50.0, "step": 30},  # a resume: the gap is not training time
        {"kind": "train", "time": 52.0, "step": 40, "loss": 0.7},
        {"kind": "train", "time": 53.0, "step": 50, "loss": 0.6},
    ])  # fmt: skip

    speed = next(ax for ax in make_figure([run]).axes if ax.get_title(loc="left") == "Throughput")

    assert speed.get_ylabel() == "steps/s"
    [line] = speed.get_lines()
    assert list(line.get_xdata()) == [20, 30, 50]
    assert list(line.get_ydata()) == [10.0, 5.0, 10.0]


def test_hookloop_train_writes_a_loss_series_that_tensorboard_reads(two_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(two_runs[0] / "tb"), size_guidance={"scalars": 0})
    acc.Reload()

    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(2, 41, 2))
    assert loss[-1].value < loss[0].value  # it learned
    assert [e.step for e in acc.Scalars("eval/loss")] == [10, 20, 30, 40]


def test_two_runs_are_overlaid_with_their_names_in_the_legend(two_runs, tmp_path):
    out = tmp_path / "both.png"
    assert command(add_plot_command, ["plot", *map(str, two_runs), "--out", str(out)]) == 0
    assert out.stat().st_size > 30_000

    fig = make_figure(list(two_runs))
    texts = legend_texts(fig)
    assert {"lr-0.05 train", "lr-0.05 eval", "lr-0.01 train", "lr-0.01 eval"} <= texts
    lr_lines = {tuple(line.get_ydata()[:1]) for line in fig.axes[1].get_lines()}
    assert lr_lines == {(0.05,), (0.01,)}  # each run's own learning rate


def test_log_scale_option_puts_the_loss_on_a_log_axis(two_runs):
    fig = make_figure([two_runs[0]], log_scale=True)

    assert fig.axes[0].get_yscale() == "log"
    assert fig.axes[0].get_title(loc="left") == "Loss (log scale)"


def test_per_parameter_norms_become_a_heatmap_in_model_order(tmp_path):
    params = ["embed.weight", "block.0.attn.weight", "head.bias"]
    records = [{"kind": "start", "time": 0.0, "step": 0}] + [
        {"kind": "train", "time": float(s), "step": s, "loss": 1.0 / s, "grad_norm": 0.5,
         **{f"grad_norm/{p}": (i + 1) * 0.1 * s for i, p in enumerate(params)}}
        for s in range(1, 21)
    ]  # fmt: skip
    run = write_log(tmp_path / "gpt", records)

    fig = make_figure([run])

    [heat] = [ax for ax in fig.axes if ax.images]
    assert heat.get_title(loc="left") == "Per-parameter grad norm (gpt)"
    assert [t.get_text() for t in heat.get_yticklabels()] == params
    grid = heat.images[0].get_array()
    assert grid.shape == (3, 20)
    assert grid[2, 19] == pytest.approx(math.log10(6.0))  # head.bias at step 20: 0.3 * 20
    assert "Gradient norm" in panel_titles(fig)


def test_logged_tokens_per_second_is_the_throughput_shown(tmp_path):
    records = [
        {"kind": "train", "time": float(s), "step": s, "loss": 1.0, "tokens_per_s": 5000.0 + s}
        for s in range(1, 6)
    ]
    fig = make_figure([write_log(tmp_path / "run", records)])

    speed = next(ax for ax in fig.axes if ax.get_title(loc="left") == "Throughput")
    assert speed.get_ylabel() == "tokens/s"
    assert list(speed.get_lines()[0].get_ydata()) == [5001.0, 5002.0, 5003.0, 5004.0, 5005.0]


def test_plot_of_a_directory_without_a_log_says_so(tmp_path):
    with pytest.raises(ValueError, match=r"no metrics\.jsonl"):
        command(add_plot_command, ["plot", str(tmp_path)])


# -- hookloop runs -----------------------------------------------------------------------------


def toy_run(out: Path, **train: object) -> None:
    cfg = Config()
    cfg.data.batch_size = 4
    cfg.train.device = "cpu"
    cfg.train.handle_signals = False
    cfg.train.log_every = 1
    cfg.train.eval_every = 2
    for key, value in train.items():
        setattr(cfg.train, key, value)
    Trainer(
        TinyModel(),
        train_data=ToyData(n=64),
        eval_data=ToyData(n=8, seed=1),
        config=cfg,
        callbacks=[JsonLogger(out / "metrics.jsonl")],
        loss_fn=TinyModel.loss_fn,
        out_dir=str(out),
    ).train()


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def start_record(pid: int, t: float = 1000.0) -> dict:
    return {"kind": "start", "time": t, "step": 0, "epoch": 0, "pid": pid,
            "host": socket.gethostname(), "resumed": False, "max_steps": 100}  # fmt: skip


def table_rows(text: str) -> dict[str, list[str]]:
    lines = text.strip().splitlines()
    assert lines[0].split() == ["RUN", "STATUS", "STEPS", "BEST", "EVAL", "LOSS", "WALL", "TIME"]
    return {line.split()[0]: line.split()[1:] for line in lines[1:]}


def test_runs_lists_finished_stopped_killed_and_running_runs(tmp_path, capsys):
    toy_run(tmp_path / "a-finished", max_steps=4)
    toy_run(tmp_path / "b-stopped", max_steps=10, exit_interval=3)
    train = {"kind": "train", "time": 1030.0, "step": 7, "loss": 0.5}
    write_log(tmp_path / "c-killed", [start_record(dead_pid()), train])
    write_log(tmp_path / "d-running", [start_record(os.getpid()), train])
    (tmp_path / "not-a-run").mkdir()

    assert command(add_runs_command, ["runs", str(tmp_path)]) == 0

    rows = table_rows(capsys.readouterr().out)
    assert set(rows) == {"a-finished", "b-stopped", "c-killed", "d-running"}
    best = min(r["eval_loss"] for r in read_jsonl(tmp_path / "a-finished/metrics.jsonl")
               if r["kind"] == "eval")  # fmt: skip
    assert rows["a-finished"][:3] == ["finished", "4/4", f"{best:.4g}"]
    assert rows["b-stopped"][:3] == ["stopped", "(exit_interval)", "3/10"]
    assert rows["c-killed"] == ["killed", "7/100", "-", "30s"]
    assert rows["d-running"][:2] == ["running", "7/100"]


def test_a_run_resumed_after_a_kill_counts_the_time_of_both_sessions(tmp_path):
    run = write_log(tmp_path / "run", [
        start_record(dead_pid(), t=0.0),
        {"kind": "train", "time": 10.0, "step": 5, "loss": 1.0},  # killed here
        start_record(dead_pid(), t=100.0),
        {"kind": "eval", "time": 120.0, "step": 8, "eval_loss": 0.25},
        {"kind": "end", "time": 130.0, "step": 8, "status": "finished", "stop_reason": "max_steps"},
    ])  # fmt: skip

    summary = summarize_run(run)

    assert summary.status == "finished"
    assert summary.wall_time_s == pytest.approx(40.0)
    assert summary.step == 8 and summary.best_eval_loss == 0.25


def test_runs_json_output_is_one_object_per_run(tmp_path, capsys):
    toy_run(tmp_path / "only", max_steps=2)

    assert command(add_runs_command, ["runs", str(tmp_path / "only"), "--json"]) == 0

    [line] = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert record["name"] == "only" and record["status"] == "finished" and record["step"] == 2


def test_runs_of_a_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        command(add_runs_command, ["runs", str(tmp_path / "nope")])
