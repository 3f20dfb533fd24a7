"""The progress log (``progress.txt``): Megatron-LM's line format, and throughput that
spans the jobs of a run killed and resumed several times."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta

import pytest

from _quiet import SERVICES_OFF
from hookloop import CallbackManager, Config, DataConfig, TrainConfig, Trainer
from hookloop.callbacks import ProgressLog, default_callbacks
from hookloop.callbacks.progress_log import TIME_FORMAT, first_job_start, format_figure
from hookloop.recipes import get_recipe
from hookloop.recipes.gpt import GPTConfig, flops_per_sample, flops_per_token
from hookloop.testing import TinyModel, ToyData

BATCH = 4


def _field(token: str) -> str:
    return token.split(": ", 1)[1]


def _lines(path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()]


def _saves(path) -> list[list[str]]:
    return [t for t in _lines(path) if t[3] == "Saved checkpoint"]


def _train(out_dir, *, steps=6, every=2, flops=1e6, callbacks=(), **train) -> Trainer:
    cfg = Config(
        train=TrainConfig(max_steps=steps, log_every=0, **train), data=DataConfig(batch_size=BATCH)
    )
    cfg.checkpoint.every = every
    trainer = Trainer(
        TinyModel(), train_data=ToyData(n=64), loss_fn=TinyModel.loss_fn, config=cfg,
        callbacks=CallbackManager([ProgressLog(), *callbacks]), out_dir=out_dir,
        flops_per_sample=flops,
    )  # fmt: skip
    trainer.train()
    return trainer


def test_each_save_writes_a_line_megatron_tools_can_parse(tmp_path):
    _train(tmp_path, steps=6, every=2, flops=1e6)

    lines = _lines(tmp_path / "progress.txt")
    assert [t[3] for t in lines] == ["Starting job"] + ["Saved checkpoint"] * 3
    for tokens in lines:
        datetime.strptime(tokens[0], TIME_FORMAT)  # Megatron's timestamp
        assert tokens[1].startswith("Job ID: ") and tokens[2] == "# GPUs: 1"
    saves = _saves(tmp_path / "progress.txt")
    # Megatron-LM reads the FLOPs as field 7 of a save line; ours are where it looks.
    assert [int(_field(t[4])) for t in saves] == [2, 4, 6]
    assert [float(_field(t[7])) for t in saves] == [2 * BATCH * 1e6, 4 * BATCH * 1e6, 6e6 * BATCH]
    for tokens in saves:
        assert tokens[5].startswith("Job throughput: ") and tokens[5].endswith(" TFLOP/s/GPU")
        assert float(_field(tokens[5]).split()[0]) > 0
        assert tokens[6].startswith("Cumulative throughput: ")
        assert tokens[8].startswith("Tokens (in billions): ")
        assert tokens[9].startswith("Save time: ") and float(_field(tokens[9])[:-2]) > 0
        assert tokens[10].startswith("Blocked: ")
    # Each job writes the same id on every line.
    assert len({t[1] for t in lines}) == 1


def test_a_run_without_a_flops_estimate_logs_zero_throughput(tmp_path):
    _train(tmp_path, steps=2, every=2, flops=None)
    (save,) = _saves(tmp_path / "progress.txt")
    assert _field(save[5]) == "0.0 TFLOP/s/GPU" and float(_field(save[7])) == 0.0


def test_the_job_id_comes_from_slurm_when_there_is_one(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    _train(tmp_path, steps=2, every=2)
    assert {t[1] for t in _lines(tmp_path / "progress.txt")} == {"Job ID: 4242"}


def test_only_rank_zero_writes(tmp_path):
    log = ProgressLog(tmp_path / "p.txt")
    trainer = _train(tmp_path / "run", steps=2, every=2)
    trainer.progress.rank = 1  # what another rank sees
    log.on_train_start(trainer.ctx)
    log.on_checkpoint_save(trainer.ctx)
    assert not (tmp_path / "p.txt").exists()


def test_first_job_start_follows_megatrons_rules(tmp_path):
    """Earliest start of the newest unbroken series with this world size, and the
    FLOPs of the last save before it (Megatron-Bridge's get_start_time_from_progress_log)."""
    path = tmp_path / "progress.txt"

    def line(t, gpus, *rest):
        return "\t".join([f"2026-01-01 00:00:{t:02d}", "Job ID: 7", f"# GPUs: {gpus}", *rest])

    def save(t, gpus, flops):
        return line(
            t, gpus, "Saved checkpoint", "Iteration: 1", "Job throughput: 1.0 TFLOP/s/GPU",
            "Cumulative throughput: 1.0 TFLOP/s/GPU", f"Floating-point operations: {flops:.2e}",
            "Tokens (in billions): 0.00",
        )  # fmt: skip

    first_part = [
        line(1, 8, "Starting job"),
        save(2, 8, 1e15),
        line(3, 4, "Starting job"),  # another world size: the count starts afresh
        save(4, 4, 2e15),
        line(5, 4, "Starting job"),
        save(6, 4, 3e15),
        "2026-01-01 00:00:07\tJob ID: 7\t# GP",  # cut short by a kill
    ]
    path.write_text("\n".join(first_part) + "\n")
    four = first_job_start(path, 4)
    assert four is not None and four.time == datetime(2026, 1, 1, 0, 0, 3) and four.flops == 1e15
    assert first_job_start(path, 8) is None  # its series was broken by the 4-rank jobs

    later = [line(8, 8, "Starting job"), save(9, 8, 4e15), line(10, 8, "Starting job")]
    path.write_text("\n".join(first_part + later) + "\n")
    eight = first_job_start(path, 8)
    assert eight is not None and eight.time == datetime(2026, 1, 1, 0, 0, 8) and eight.flops == 3e15
    assert first_job_start(path, 4) is None and first_job_start(path, 2) is None
    assert first_job_start(tmp_path / "missing.txt", 4) is None


def test_figures_keep_megatrons_decimals_and_stay_readable_below_one():
    assert format_figure(181.25, 1) == "181.2" and format_figure(3.0, 1) == "3.0"
    assert format_figure(0.0, 2) == "0.00"
    assert format_figure(4.6781e-06, 1) == "4.678e-06" and float(format_figure(0.01234, 1)) > 0


def test_bad_arguments_name_what_is_allowed(tmp_path):
    with pytest.raises(TypeError, match="path must be a str, a Path or None"):
        ProgressLog(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="job must be a non-empty str without tabs"):
        ProgressLog(job="a\tb")
    with pytest.raises(ValueError, match=r"flops_per_sample must be a finite number > 0"):
        Trainer(TinyModel(), train_data=ToyData(), loss_fn=TinyModel.loss_fn, flops_per_sample=-1)
    with pytest.raises(ValueError, match=r"train.flops_per_sample must be a finite number > 0"):
        Config(train=TrainConfig(flops_per_sample=float("nan"))).validate()


def test_a_flops_figure_in_the_config_wins_over_the_recipes(tmp_path):
    trainer = _train(tmp_path, steps=2, every=2, flops=1e6, flops_per_sample=5e6)
    assert trainer.state.flops == 2 * BATCH * 5e6
    (save,) = _saves(tmp_path / "progress.txt")
    assert float(_field(save[7])) == 2 * BATCH * 5e6


def test_the_gpt_recipe_counts_6n_plus_attention_flops_per_token():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8)
    n = 10_000
    assert flops_per_token(cfg, n) == 6 * n + 12 * 2 * 8 * 16
    assert flops_per_sample(cfg, n) == 8 * flops_per_token(cfg, n)
    with pytest.raises(ValueError, match="n_params must be an int >= 1"):
        flops_per_token(cfg, 0)


def test_hookloop_train_writes_the_progress_log_unless_switched_off(tmp_path):
    cfg = get_recipe("mlp-regression").default_config()
    assert any(isinstance(cb, ProgressLog) for cb in default_callbacks(cfg, tmp_path))
    assert not any(isinstance(cb, ProgressLog) for cb in default_callbacks(cfg, None))
    cfg.logging.progress_log = False
    assert not any(isinstance(cb, ProgressLog) for cb in default_callbacks(cfg, tmp_path))


# -- killed and resumed: the judged behaviour -------------------------------------------------


def _stamp(tokens: list[str]) -> datetime:
    return datetime.strptime(tokens[0], TIME_FORMAT)


def _wait_for_save_of(job: int, path, proc, timeout: float = 120.0) -> None:
    """Until job number ``job`` (0-based, by its Starting line) has logged a save."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before it was killed"
        lines = _lines(path) if path.exists() else []
        starts = [i for i, t in enumerate(lines) if len(t) > 3 and t[3] == "Starting job"]
        if len(starts) > job and any(
            len(t) > 3 and t[3] == "Saved checkpoint" for t in lines[starts[job] :]
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"job {job} logged no save within {timeout} s")


@pytest.mark.slow
def test_throughput_spans_three_restarts_after_sigkill(tmp_path):
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "hookloop", "train", "--recipe", "mlp-regression",
        "--out", str(run), "--resume", "auto", "train.max_steps=1000000", "train.log_every=0",
        "train.eval_every=null", "checkpoint.every=5", "logging.progress=false",
        "callbacks.info=false", *SERVICES_OFF,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    for job in range(4):  # the first job and three restarts, each SIGKILLed after a save
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            _wait_for_save_of(job, run / "progress.txt", proc)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)

    lines = [t for t in _lines(run / "progress.txt") if len(t) > 3]  # a kill may cut one short
    starts = [t for t in lines if t[3] == "Starting job"]
    assert len(starts) == 4 and len({t[1] for t in starts}) == 4  # four jobs, four ids
    assert all(t[2] == "# GPUs: 1" for t in lines)
    saves = [t for t in lines if t[3] == "Saved checkpoint" and len(t) == 11]
    # The run continues: every job's saves go on from where the one before left off.
    iterations = [int(_field(t[4])) for t in saves]
    assert iterations == sorted(set(iterations)) and iterations[0] == 5
    recipe = get_recipe("mlp-regression")
    per_sample = recipe.build(recipe.default_config()).flops_per_sample
    batch = recipe.default_config().data.batch_size
    first_start = _stamp(starts[0])
    job_starts = [_stamp(t) for t in starts]
    later_saves = [t for t in saves if _stamp(t) > job_starts[1]]
    assert later_saves, "no save after the first restart"
    for tokens in saves:
        flops = float(_field(tokens[7]))
        assert flops == pytest.approx(int(_field(tokens[4])) * batch * per_sample, rel=6e-3)
    for tokens in later_saves:
        # Cumulative throughput counts from the FIRST job's start (whole seconds on both
        # ends of the interval, so it is bracketed), not from this job's.
        flops = float(_field(tokens[7]))
        cumulative = float(_field(tokens[6]).split()[0])
        elapsed = (_stamp(tokens) - first_start).total_seconds()
        low, high = flops / (elapsed + 1) / 1e12, flops / max(elapsed - 1, 0.5) / 1e12
        assert low * 0.999 <= cumulative <= high * 1.001, (tokens, first_start)
        # ... which a count from this job's own start could not match.
        own = max(j for j in job_starts if j <= _stamp(tokens))
        if (own - first_start) > timedelta(seconds=2):
            since_own = (_stamp(tokens) - own).total_seconds()
            assert cumulative < flops / (since_own + 1) / 1e12
