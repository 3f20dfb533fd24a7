"""The native built-ins Forgather also has: metrics, progress, run info, divergence, norms, memory,
text samples and profiling. Pure parts are tested on plain numbers, adapters on
short real runs (TinyModel, or a one-layer byte GPT)."""

from __future__ import annotations

import io
import json
import math
import random
import resource
import shutil
from pathlib import Path

import pytest
import torch

from _reference import GradsSeen
from hookloop import CallbackContext, Config, Trainer
from hookloop.callback import Callback
from hookloop.callbacks.divergence import DivergenceDetector, SpikeTracker
from hookloop.callbacks.info import InfoCallback, count_parameters
from hookloop.callbacks.memory import PeakMemory, peak_rss_mib
from hookloop.callbacks.metrics import DefaultMetrics, throughput
from hookloop.callbacks.norms import (
    GradNormLogger,
    ParameterNormLogger,
    WeightNormLogger,
    spectral_norm,
)
from hookloop.callbacks.profiler import ProfilerCallback
from hookloop.callbacks.progress import Column, ProgressBar, resolve_columns
from hookloop.callbacks.textgen import TextgenCallback
from hookloop.compat.hf import ProgressCallback
from hookloop.recipes.gpt import GPT, GPTConfig, forward_step, split_corpus
from hookloop.testing import TinyModel, ToyData

# -- helpers -------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def one_thread():
    """These runs are tiny: one intra-op thread is faster on a small, shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CORPUS = b"".join(f"def add_{i}(a, b):\n    return a + b + {i}\n\n".encode() for i in range(150))


def gpt_trainer(callbacks=(), *, out_dir=None, resume=None, dropout=0.0, **train) -> Trainer:
    """A one-layer byte GPT on a tiny, very learnable corpus."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, dropout=dropout))
    train_data, eval_data = split_corpus(CORPUS, 16, 0.1)
    cfg = Config()
    cfg.data.batch_size, cfg.data.eval_batch_size = 8, 16
    cfg.optimizer.lr = 3e-3
    cfg.train.device, cfg.train.handle_signals, cfg.train.log_every = "cpu", False, 0
    cfg.train.eval_max_batches = 2
    cfg.checkpoint.keep_last = None
    configure(cfg, train)
    return Trainer(
        model,
        train_data=train_data,
        eval_data=eval_data,
        config=cfg,
        callbacks=list(callbacks),
        forward_step=forward_step,
        out_dir=None if out_dir is None else str(out_dir),
        resume=resume,
    )


def configure(cfg: Config, values: dict) -> None:
    """``max_steps=4`` sets ``cfg.train.max_steps``; ``checkpoint__every=2`` another section."""
    for key, value in values.items():
        section, _, name = key.rpartition("__")
        setattr(getattr(cfg, section or "train"), name, value)


class ScriptedLogs(Callback):
    """Overwrites ``logs[key]`` with the next scripted value at each log event."""

    priority = 0

    def __init__(self, values, key="loss"):
        self.values, self.key = list(values), key

    def on_before_log(self, ctx):
        if self.values:
            ctx.logs[self.key] = self.values.pop(0)


class LogsSeen(Callback):
    """Keeps a copy of every log event (runs after every producer)."""

    priority = 200

    def __init__(self):
        self.logs: list[dict] = []

    def on_log(self, ctx):
        self.logs.append({"step": ctx.state.step, **ctx.logs})


def tiny_trainer(callbacks, *, out_dir=None, resume=None, n=32, eval_n=None, **train):
    cfg = Config()
    cfg.data.batch_size = 4
    cfg.train.device, cfg.train.handle_signals, cfg.train.log_every = "cpu", False, 0
    cfg.checkpoint.keep_last = None
    configure(cfg, train)
    return Trainer(
        TinyModel(),
        train_data=ToyData(n=n),
        eval_data=ToyData(n=eval_n, seed=1) if eval_n else None,
        config=cfg,
        callbacks=list(callbacks),
        loss_fn=TinyModel.loss_fn,
        out_dir=None if out_dir is None else str(out_dir),
        resume=resume,
    )


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_same_state(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def resumed_state(make, tmp_path, **train):
    """State of a callback after a run, and of a fresh one restored from its checkpoint."""
    first = make()
    tiny_trainer([first], out_dir=tmp_path, **train).train()
    second = make()
    tiny_trainer([second], out_dir=tmp_path, resume="auto", **train).train()
    return first.state_dict(), second.state_dict()


# -- DefaultMetrics --------------------------------------------------------------------------


def test_throughput_turns_counts_and_seconds_into_rates():
    rates = throughput(4.0, samples=64, tokens=1024, flops=6e12, train_seconds=3.0, peak_flops=1e13)
    assert rates == {"samples_per_sec": 16.0, "tok_per_sec": 256.0, "mfu": pytest.approx(0.2)}
    assert throughput(0.0, samples=64) == {}  # no time elapsed: no rate
    assert "mfu" not in throughput(1.0, samples=8, flops=1e9, train_seconds=1.0)  # no peak
    assert "tok_per_sec" not in throughput(1.0, samples=8)  # tokens unknown


class StepClock:
    """A clock that advances one second per reading."""

    def __init__(self):
        self.now = -1.0

    def __call__(self):
        self.now += 1.0
        return self.now


def test_default_metrics_rates_and_mfu_follow_the_counters():
    metrics = DefaultMetrics(peak_flops=1000.0, seq_len=7)
    metrics.clock = StepClock()
    seen = LogsSeen()
    trainer = tiny_trainer([metrics, seen], max_steps=4, log_every=2)
    trainer.flops_per_sample = 10.0  # the estimate a recipe would give
    trainer.train()
    # Readings: train start 0; each step 2 (start, end); each log 1. Per log interval:
    # 5 s of wall time, 2 s inside steps, 2 steps x 4 samples.
    for logs in seen.logs:
        assert logs["samples_per_sec"] == pytest.approx(8 / 5)
        assert logs["tok_per_sec"] == pytest.approx(8 * 7 / 5)  # samples x seq_len
        assert logs["mfu"] == pytest.approx(8 * 10.0 / 2 / 1000.0)
        assert logs["peak_mem_mib"] > 0  # peak RSS on the CPU
    assert [logs["step"] for logs in seen.logs] == [2, 4]


def test_default_metrics_counts_tokens_the_forward_step_reports():
    seen = LogsSeen()
    gpt_trainer([DefaultMetrics(), seen], max_steps=2, log_every=2).train()
    (logs,) = seen.logs
    assert logs["tok_per_sec"] == pytest.approx(logs["samples_per_sec"] * 16)  # block_size
    assert "mfu" not in logs  # no peak_flops given


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"peak_flops": 0}, "peak_flops"),
        ({"peak_flops": float("inf")}, "peak_flops"),
        ({"seq_len": 0}, "seq_len"),
        ({"memory": "yes"}, "memory"),
        ({"peak_flops": 1e12, "peak_hardware_flops": 1e12}, "peak_hardware_flops"),
    ],
)
def test_default_metrics_rejects_bad_arguments_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DefaultMetrics(**kwargs)


def test_default_metrics_accepts_forgathers_parameter_name():
    assert DefaultMetrics(peak_hardware_flops=312e12).peak_flops == 312e12


# -- ProgressCallback ------------------------------------------------------------------------


def test_plain_output_is_a_table_whose_header_repeats_every_header_every_rows():
    out = io.StringIO()
    tiny_trainer([ProgressBar(stream=out, header_every=3)], max_steps=7, log_every=1).train()
    lines = out.getvalue().splitlines()
    headers = [i for i, line in enumerate(lines) if line.split()[:2] == ["step", "loss"]]
    rows = [line for line in lines if line.lstrip()[:1].isdigit()]
    assert headers == [0, 4, 8]  # before rows 1, 4 and 7
    assert [r.split()[0] for r in rows] == [f"{s}/7" for s in range(1, 8)]
    assert len(rows[0].split()) == len(lines[0].split())  # one cell per heading
    assert lines[-1] == "training ended at step 7: max_steps"


def test_plain_header_is_reprinted_when_the_columns_change():
    out = io.StringIO()
    bar = ProgressBar(stream=out, header_every=100)
    ctx = CallbackContext()
    bar.on_train_start(ctx)
    for logs in ({"loss": 1.0}, {"loss": 0.9}, {"loss": 0.8, "lr": 0.1}):
        ctx.logs = logs
        bar.on_log(ctx)
    lines = out.getvalue().splitlines()
    assert [line.split()[:3] for line in lines if line.lstrip().startswith("step")] == [
        ["step", "loss", "steps/s"],
        ["step", "loss", "lr"],
    ]


def test_columns_take_a_list_or_overrides_of_the_defaults():
    assert [c.key for c in resolve_columns(["loss", "mfu", "acc"])] == ["loss", "mfu", "acc"]
    assert resolve_columns(["mfu"])[0].format(0.4123) == "41.2%"  # keeps the default format
    merged = resolve_columns({"lr": None, "loss": {"fmt": ".2f"}, "acc": {"label": "accuracy"}})
    keys = [c.key for c in merged]
    assert "lr" not in keys and keys[0] == "loss" and keys[-1] == "acc"
    assert merged[0].format(1.23456) == "1.23"
    assert merged[-1].title == "accuracy"
    with pytest.raises(ValueError, match="unknown fields"):
        resolve_columns({"loss": {"colour": "red"}})
    with pytest.raises(ValueError, match=r"Column\.fmt"):
        Column("loss", fmt="nonsense")
    with pytest.raises(ValueError, match="columns"):
        resolve_columns("loss")


def test_bars_cover_training_and_each_evaluation():
    out = io.StringIO()
    bar = ProgressBar(stream=out, use_tqdm=True)
    tiny_trainer([bar], n=32, eval_n=12, max_steps=4, log_every=2, eval_every=2).train()
    text = out.getvalue()
    assert "4/4" in text  # the training bar reached the end
    assert text.count("eval:   0%|          | 0/3") == 2  # a bar per evaluation, 3 batches
    assert bar._eval_total == {"eval": 3}  # and it counted all of them
    assert "eval @ step 2 | eval_loss" in text and "eval @ step 4 | eval_loss" in text
    assert bar._bar is None and bar._eval_bar is None  # closed at the end


def test_progress_bar_keeps_its_name_and_accepts_forgathers_arguments():
    assert ProgressCallback.__mro__[1] is ProgressBar  # Forgather's name lives in compat
    with pytest.raises(ImportError, match=r"hookloop\.compat\.forgather"):
        from hookloop.callbacks import ProgressCallback as _  # noqa: F401
    bar = ProgressBar(output_stream="stdout", step_columns={"lr": None}, header_interval=5)
    assert bar.header_every == 5 and bar.stream == "stdout"
    assert "lr" not in [c.key for c in bar.columns]
    for kwargs, name in (({"header_every": 0}, "header_every"), ({"stream": "log"}, "stream")):
        with pytest.raises(ValueError, match=name):
            ProgressBar(**kwargs)


# -- InfoCallback ----------------------------------------------------------------------------


def test_info_prints_a_run_summary_and_shares_it_in_user_state():
    out = io.StringIO()
    trainer = tiny_trainer([InfoCallback(stream=out)], n=32, eval_n=8, max_steps=3, grad_accum=2)
    trainer.train()
    info = trainer.callbacks.user_state["run_info"]
    assert info["parameters"] == sum(p.numel() for p in trainer.model.parameters()) == 49
    assert info["trainable_parameters"] == 49
    assert info["device"] == "cpu" and info["precision"] == "fp32"
    assert info["batch_size"] == 4 and info["grad_accum"] == 2 and info["world_size"] == 1
    assert info["global_batch_size"] == 8 and info["max_steps"] == 3
    assert info["optimizer"] == "AdamW"
    assert info["train_samples"] == 32 and info["eval_samples"] == 8
    text = out.getvalue()
    assert text.startswith("run info:") and "max_steps" in text and "AdamW" in text


def test_parameter_counts_tied_weights_once_and_frozen_ones_as_untrainable():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied: 40 numbers, not 80
    frozen = torch.nn.Linear(4, 2)
    frozen.requires_grad_(False)
    both = torch.nn.ModuleList([model, frozen])
    assert count_parameters(both) == (40 + 10, 40)


def test_info_verbose_adds_each_submodule_and_bad_arguments_are_named():
    info = InfoCallback(stream=None, verbose=True)
    tiny_trainer([info], max_steps=1).train()
    assert info.info["parameters.net"] == 49
    with pytest.raises(ValueError, match="stream"):
        InfoCallback(stream="console")
    with pytest.raises(ValueError, match="verbose"):
        InfoCallback(verbose="yes")


# -- DivergenceDetector: the tracker on plain numbers -------------------------------------------


def decaying(n, start=10.0, floor=3.8, rate=0.05):
    return [floor + (start - floor) * math.exp(-rate * i) for i in range(n)]


def first_trigger(tracker, values):
    for i, value in enumerate(values):
        if tracker.update(value) is not None:
            return i
    return None


@pytest.mark.parametrize("patience", [1, 3, 5])
def test_divergence_fires_within_patience_observations_of_a_spike(patience):
    healthy = decaying(80)
    spike_at = len(healthy)
    values = healthy + [9.7] * 20  # the loss jumps back to ~10, as in a real divergence
    fired = first_trigger(SpikeTracker(patience=patience), values)
    assert fired is not None
    assert spike_at <= fired < spike_at + patience


HEALTHY = {
    "decaying": decaying(300),
    "slow power-law decay": [2.0 + 8.0 / (1 + i) ** 0.5 for i in range(300)],
    "plateau": [3.8] * 300,
    "early plateau then decay": [10.0] * 20 + decaying(280),
}
for _seed in range(5):
    _rng = random.Random(_seed)
    HEALTHY[f"noisy decay, seed {_seed}"] = [v + _rng.gauss(0, 0.15) for v in decaying(300)]
    HEALTHY[f"noisy plateau, seed {_seed}"] = [3.8 + _rng.gauss(0, 0.2) for _ in range(300)]


@pytest.mark.parametrize("curve", sorted(HEALTHY))
@pytest.mark.parametrize(
    "settings", [{}, {"threshold": None, "relative_threshold": 1.5}, {"patience": 1}]
)
def test_divergence_never_fires_on_healthy_curves(curve, settings):
    assert first_trigger(SpikeTracker(**settings), HEALTHY[curve]) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_loss_fires_at_once_even_in_warmup(bad):
    tracker = SpikeTracker(patience=5, warmup=10)
    assert tracker.update(5.0) is None
    assert "non-finite" in tracker.update(bad)
    assert tracker.observations == 1  # the bad value does not enter the average


def test_warmup_observations_never_count_as_above():
    values = [1.0, 20.0, 20.0, 20.0, 20.0]
    assert first_trigger(SpikeTracker(patience=1, warmup=4), values) == 4
    assert first_trigger(SpikeTracker(patience=1, warmup=0), values) == 1


def test_relative_threshold_compares_the_average_with_its_best():
    tracker = SpikeTracker(smoothing=1.0, threshold=None, relative_threshold=1.5, warmup=0,
                           patience=1)  # fmt: skip
    assert [tracker.update(v) is None for v in (2.0, 1.0, 1.4, 1.49)] == [True] * 4
    assert "relative_threshold" in tracker.update(1.5)
    # A negative best turns the ratio test off rather than inverting it.
    negative = SpikeTracker(smoothing=1.0, threshold=None, relative_threshold=1.5, warmup=0)
    assert first_trigger(negative, [-1.0, -2.0, -0.5, -0.5, -0.5]) is None


def test_a_healthy_observation_resets_the_patience_count():
    tracker = SpikeTracker(smoothing=1.0, threshold=1.0, patience=2, warmup=0)
    assert first_trigger(tracker, [1.0, 3.0, 1.0, 3.0, 1.0, 3.0]) is None
    assert tracker.update(3.0) is not None  # two in a row


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"smoothing": 0}, "smoothing"),
        ({"smoothing": 1.5}, "smoothing"),
        ({"threshold": -1}, "threshold"),
        ({"relative_threshold": 0.9}, "relative_threshold"),
        ({"threshold": None}, "threshold"),  # and relative_threshold None too
        ({"patience": 0}, "patience"),
        ({"warmup": -1}, "warmup"),
        ({"action": "halt"}, "action"),
        ({"metric_key": ""}, "metric_key"),
    ],
)
def test_divergence_detector_rejects_bad_arguments_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DivergenceDetector(**kwargs)


# -- DivergenceDetector: the callback on real runs ----------------------------------------------


def test_detector_stops_a_run_whose_logged_loss_explodes():
    script = decaying(12, rate=0.5) + [9.7] * 10  # one value per log step
    detector = DivergenceDetector(patience=3, warmup=5)
    result = tiny_trainer(
        [ScriptedLogs(script), detector], n=400, max_steps=40, log_every=1
    ).train()
    assert result.step == 12 + 3  # the 13th log is the spike; the 3rd one above stops
    assert result.stop_reason.startswith("divergence: loss smoothed")
    assert result.exit_code == 4  # a divergence stop is a failure


def test_abort_action_ends_the_run_without_saving(tmp_path):
    detector = DivergenceDetector(patience=1, warmup=0, action="abort")
    result = tiny_trainer(
        [ScriptedLogs([1.0, 1.0, 50.0]), detector], out_dir=tmp_path, max_steps=10, log_every=1
    ).train()
    assert result.step == 3 and result.stop_reason.startswith("abort: divergence")
    assert result.exit_code == 4  # failed, whatever the action
    assert not list((tmp_path / "checkpoints").glob("step-*"))


class PoisonBatch(Callback):
    """Turns the inputs of step ``at`` into NaN: a real non-finite loss."""

    def __init__(self, at):
        self.at = at

    def on_micro_step_start(self, ctx):
        if ctx.state.step == self.at:
            ctx.batch[0].fill_(float("nan"))


def test_a_nan_loss_at_step_k_stops_the_run_at_step_k():
    detector = DivergenceDetector(warmup=100, patience=10)
    result = tiny_trainer(
        [PoisonBatch(at=4), detector], max_steps=8, log_every=1, skip_nonfinite=False
    ).train()
    assert result.step == 4
    assert "non-finite" in result.stop_reason


def test_detector_can_watch_eval_loss_and_then_ignores_the_training_loss():
    detector = DivergenceDetector(use_eval_loss=True, warmup=0, patience=1)
    assert detector.name == "DivergenceDetector[eval_loss]"
    ctx = CallbackContext()
    ctx.logs = {"loss": float("nan")}
    detector.on_log(ctx)
    assert not ctx.control.stop_requested
    for value in (2.0, 1.0, 10.0):
        ctx.metrics = {"eval_loss": value}
        detector.on_eval_end(ctx)
    assert ctx.control.stop_requested


def test_detector_state_round_trips_through_a_checkpoint(tmp_path):
    def make():
        return DivergenceDetector(warmup=1)

    saved, restored = resumed_state(make, tmp_path, max_steps=6, log_every=1)
    assert saved["observations"] == 6 and saved["smoothed"] is not None
    assert_same_state(saved, restored)


# -- norm loggers -----------------------------------------------------------------------------


def test_grad_norms_are_the_clipped_gradients_the_optimizer_uses():
    logger, reference, seen = GradNormLogger(), GradsSeen(), LogsSeen()
    tiny_trainer([logger, reference, seen], max_steps=4, log_every=2, clip_grad_norm=0.01).train()
    assert [logs["step"] for logs in seen.logs] == [2, 4]
    for logs in seen.logs:
        expected = reference.norms[logs["step"]]
        got = {k[len("grad_norm/") :]: v for k, v in logs.items() if k.startswith("grad_norm/")}
        total = got.pop("total")
        assert got == pytest.approx(expected, rel=1e-5)
        assert total == pytest.approx(0.01, rel=1e-3)  # clipped to 0.01 ...
        assert logs["grad_norm"] > 0.01  # ... from the larger norm the loop reports


def test_grad_norms_are_captured_only_on_steps_that_will_be_logged():
    logger = GradNormLogger(include=["net.0.*"])
    captured = []

    class Spy(Callback):
        priority = 30

        def on_before_optimizer_step(self, ctx):
            captured.append((ctx.state.step, list(logger._names), len(logger._norms)))

    tiny_trainer([logger, Spy()], max_steps=4, log_every=3).train()
    assert captured[:2] == [(1, [], 0), (2, [], 0)]  # nothing held before step 3
    assert captured[2] == (3, ["net.0.weight", "net.0.bias"], 2)  # tensors, not numbers
    assert logger._norms == []  # consumed by the log at step 3


def test_grad_norm_file_matches_an_uninterrupted_run_after_a_resume(tmp_path):
    def run(out, resume=None):
        logger = GradNormLogger(path=out / "grad_norms.jsonl")
        train = {"max_steps": 8, "log_every": 2, "checkpoint__every": 4}
        tiny_trainer([logger], out_dir=out, resume=resume, **train).train()
        return (out / "grad_norms.jsonl").read_text()

    uninterrupted = run(tmp_path / "a")
    run(tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-00000008")  # as if killed after step 4
    resumed = run(tmp_path / "b", resume="auto")
    records = [json.loads(line) for line in resumed.splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6, 8]  # steps 6 and 8 not written twice
    assert resumed == uninterrupted


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48), (10, 200)])
def test_spectral_norm_estimate_matches_the_exact_matrix_norm(shape):
    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    exact = torch.linalg.matrix_norm(matrix, ord=2).item()
    sigma, v = spectral_norm(matrix, iters=50)
    assert sigma.item() <= exact * (1 + 1e-5)  # power iteration approaches from below
    assert sigma.item() == pytest.approx(exact, rel=0.03)
    for _ in range(20):  # warm starts keep improving the same estimate
        sigma, v = spectral_norm(matrix, v, iters=10)
    assert sigma.item() == pytest.approx(exact, rel=2e-3)


def test_warm_start_converges_faster_than_starting_cold():
    matrix = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    exact = torch.linalg.matrix_norm(matrix, ord=2).item()
    _, v = spectral_norm(matrix, iters=30)
    warm, _ = spectral_norm(matrix, v, iters=3)
    cold, _ = spectral_norm(matrix, iters=3)
    assert exact - warm.item() < (exact - cold.item()) / 10


def test_parameter_norms_and_spectral_norms_of_a_trained_model():
    logger, seen = ParameterNormLogger(power_iters=20), LogsSeen()
    trainer = tiny_trainer([logger, seen], max_steps=4, log_every=2)
    trainer.train()
    logs = seen.logs[-1]
    for name, p in trainer.model.named_parameters():
        assert logs[f"param_norm/{name}"] == pytest.approx(p.norm().item(), rel=1e-5)
    for name in ("net.0.weight", "net.2.weight"):
        exact = torch.linalg.matrix_norm(trainer.model.get_parameter(name).detach(), ord=2)
        assert logs[f"spectral_norm/{name}"] == pytest.approx(exact.item(), rel=1e-3)
    assert "spectral_norm/net.0.bias" not in logs  # vectors have no spectral norm
    assert set(logger.vectors) == {"net.0.weight", "net.2.weight"}  # the warm starts


def test_parameter_norm_warm_starts_round_trip_through_a_checkpoint(tmp_path):
    saved, restored = resumed_state(ParameterNormLogger, tmp_path, max_steps=4, log_every=2)
    assert set(saved["vectors"]) == {"net.0.weight", "net.2.weight"}
    assert_same_state(saved, restored)


def test_parameter_norm_logger_accepts_forgathers_names_and_rejects_bad_ones():
    assert ParameterNormLogger(power_iter_steps=4).power_iters == 4
    for kwargs, name in (
        ({"power_iters": 0}, "power_iters"),
        ({"log_norms": 1}, "log_norms"),
        ({"include": "net.*"}, "include"),
        ({"path": ""}, "path"),
    ):
        with pytest.raises(ValueError, match=name):
            ParameterNormLogger(**kwargs)


def test_weight_norm_is_the_norm_of_all_parameters_together():
    seen = LogsSeen()
    trainer = tiny_trainer([WeightNormLogger(), seen], max_steps=2, log_every=2)
    trainer.train()
    flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    assert seen.logs[-1]["weight_norm"] == pytest.approx(flat.norm().item(), rel=1e-6)


# -- PeakMemory ------------------------------------------------------------------------------


def test_peak_memory_logs_the_process_peak_rss_on_cpu():
    seen = LogsSeen()
    tiny_trainer([PeakMemory(), seen], max_steps=2, log_every=1).train()
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    for logs in seen.logs:
        assert 0 < logs["peak_rss_mib"] <= kib / 1024
        assert "peak_mem_allocated_mib" not in logs  # CUDA numbers only on a CUDA device
    assert peak_rss_mib() >= seen.logs[-1]["peak_rss_mib"]  # a peak never goes down


def test_peak_memory_rejects_bad_arguments_by_name():
    with pytest.raises(ValueError, match="reset_every_log"):
        PeakMemory(reset_every_log="yes")
    with pytest.raises(ValueError, match="max_snapshot_entries"):
        PeakMemory(max_snapshot_entries=0)


# -- TextgenCallback --------------------------------------------------------------------------

PROMPTS = ["def add_", "    return "]


def test_samples_change_as_the_model_trains(tmp_path):
    textgen = TextgenCallback(PROMPTS, max_new_tokens=16, print_samples=False)
    trainer = gpt_trainer([textgen], out_dir=tmp_path, max_steps=12, eval_every=6)
    trainer.evaluate()  # the untrained model's samples, at step 0
    before = [s["text"] for s in trainer.callbacks.user_state["samples"]]
    trainer.evaluate()
    assert [s["text"] for s in textgen.samples] == before  # same weights, same samples
    trainer.train()
    after = trainer.callbacks.user_state["samples"]
    assert [s["step"] for s in after] == [12, 12]
    assert [s["prompt"] for s in after] == PROMPTS
    assert all(a["text"] != b for a, b in zip(after, before, strict=True))
    text = (tmp_path / "samples.txt").read_text()
    assert [line for line in text.splitlines() if line.startswith("===")] == [
        "=== step 0 ===",
        "=== step 0 ===",
        "=== step 6 ===",
        "=== step 12 ===",
    ]
    assert after[0]["prompt"] + after[0]["text"] in text


def draws_from_the_global_rng(model, prompt):
    return prompt + "".join("ab"[int(torch.rand(()) < 0.5)] for _ in range(8))


@pytest.mark.parametrize("generate_fn", [None, draws_from_the_global_rng])
def test_textgen_leaves_the_global_rng_untouched(generate_fn):
    textgen = TextgenCallback(PROMPTS, generate_fn=generate_fn, print_samples=False)
    trainer = gpt_trainer([textgen])
    torch.manual_seed(123)
    before = torch.get_rng_state()
    ctx = trainer.ctx
    textgen.on_eval_end(ctx)
    assert torch.equal(torch.get_rng_state(), before)
    first = [s["text"] for s in textgen.samples]
    textgen.on_eval_end(ctx)
    assert [s["text"] for s in textgen.samples] == first  # re-seeded each time


def test_training_with_samples_ends_with_the_same_weights_as_without():
    def final_weights(callbacks):
        trainer = gpt_trainer(callbacks, dropout=0.1, max_steps=6, eval_every=2)
        trainer.train()
        return [p.detach().clone() for p in trainer.model.parameters()]

    plain = final_weights([])
    sampled = final_weights([TextgenCallback(PROMPTS, max_new_tokens=8, print_samples=False)])
    assert all(torch.equal(a, b) for a, b in zip(plain, sampled, strict=True))


def test_a_resumed_run_writes_the_same_samples_file(tmp_path):
    def run(out, resume=None):
        textgen = TextgenCallback(PROMPTS, max_new_tokens=8, print_samples=False)
        cfg = {"max_steps": 8, "eval_every": 2, "checkpoint__every": 4}
        gpt_trainer([textgen], out_dir=out, resume=resume, **cfg).train()
        return (out / "samples.txt").read_text()

    uninterrupted = run(tmp_path / "a")
    run(tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-00000008")  # as if killed after step 4
    assert run(tmp_path / "b", resume="auto") == uninterrupted
    assert uninterrupted.count("=== step") == 4


def test_prompts_come_from_a_list_or_a_yaml_file(tmp_path):
    file = tmp_path / "prompts.yaml"
    file.write_text("- 'def '\n- 'class '\n")
    assert TextgenCallback(file).prompts == ["def ", "class "]
    with pytest.raises(ValueError, match=r"pass \['def '\]"):
        TextgenCallback("def ")
    for kwargs, name in (
        ({"prompts": []}, "prompts"),
        ({"prompts": ["a"], "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompts": ["a"], "temperature": -1}, "temperature"),
        ({"prompts": ["a"], "generate_fn": "gpt"}, "generate_fn"),
    ):
        with pytest.raises(ValueError, match=name):
            TextgenCallback(**kwargs)


# -- ProfilerCallback -------------------------------------------------------------------------


def test_profiler_writes_a_chrome_trace_and_summary_tables(tmp_path):
    profiler = ProfilerCallback(wait=1, warmup=1, active=2)
    tiny_trainer([profiler], out_dir=tmp_path, max_steps=6).train()
    trace, summary = profiler.files
    assert trace.parent == tmp_path / "profile" and trace.name == "trace_step4_rank0.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
    table = summary.read_text()
    assert "sorted by self CPU time" in table and "aten::" in table
    assert profiler._prof is None  # stopped once the window was recorded


def test_profiler_window_cut_short_by_the_end_of_training_is_still_written(tmp_path):
    profiler = ProfilerCallback(wait=0, warmup=1, active=10, output_dir=tmp_path / "p")
    tiny_trainer([profiler], max_steps=3).train()
    assert [f.name for f in profiler.files] == ["trace_step3_rank0.json", "summary_step3_rank0.txt"]
    assert json.loads(profiler.files[0].read_text())["traceEvents"]


def test_profiler_takes_forgathers_window_of_start_step_and_num_steps(tmp_path):
    profiler = ProfilerCallback(start_step=2, num_steps=2, output_dir=tmp_path)
    assert (profiler.wait, profiler.warmup, profiler.active) == (1, 1, 2)
    tiny_trainer([profiler], max_steps=5).train()
    assert profiler.files[0].name == "trace_step4_rank0.json"  # steps 3 and 4 recorded
    with pytest.raises(ValueError, match="num_steps"):
        ProfilerCallback(start_step=2, num_steps=0)


def test_profiler_rejects_bad_windows_by_name():
    for kwargs, name in (
        ({"active": 0}, "active"),
        ({"wait": -1}, "wait"),
        ({"ranks": "0"}, "ranks"),
    ):
        with pytest.raises(ValueError, match=name):
            ProfilerCallback(**kwargs)


# -- all of them together -------------------------------------------------------------------


def test_every_callback_survives_two_train_calls_and_a_test_run(tmp_path):
    callbacks = [
        DefaultMetrics(peak_flops=1e12),
        ProgressBar(stream=io.StringIO()),
        InfoCallback(stream=None),
        DivergenceDetector(),
        GradNormLogger(),
        ParameterNormLogger(),
        WeightNormLogger(),
        PeakMemory(),
        TextgenCallback(["x"], generate_fn=draws_from_the_global_rng, print_samples=False),
        ProfilerCallback(output_dir=tmp_path / "p"),
    ]
    trainer = tiny_trainer(callbacks, eval_n=8, max_steps=3, log_every=1, eval_every=3)
    first = trainer.train()
    second = trainer.train()  # the budget is spent: starts, ends, and nothing breaks
    trainer.test(ToyData(n=8, seed=3))
    assert first.step == second.step == 3 and math.isfinite(first.logs["weight_norm"])
    assert Path(tmp_path / "p").is_dir()
