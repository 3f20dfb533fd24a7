"""PeakMemory on CUDA: run on a machine with a GPU (`pytest gpu_tests`); the CPU suite in
tests/ never collects this folder, so it runs there with nothing skipped."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_forgather_builtins import PeakMemory, summary_writer, tb, train

assert torch.cuda.is_available(), "gpu_tests/ needs a CUDA device"


def test_peak_memory_logs_per_rank_peaks_on_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the snapshot goes to the working directory, as in Forgather
    writer = summary_writer(tmp_path / "tb")
    memory = PeakMemory(writer, False, True, True, "snap")
    train(tmp_path, [memory], use_cpu=False)
    writer.close()
    peaks = tb(tmp_path / "tb").Scalars("peak_memory_rank0")
    assert {2, 4, 6} <= {e.step for e in peaks}
    assert all(e.value > 0 for e in peaks)
    err = capsys.readouterr().err
    assert "Peak CUDA Memory Allocated: RANK0" in err and "RANK0 MAX CUDA MEMORY ALLOCATED" in err
    assert (tmp_path / "snap_rank0.pickle").stat().st_size > 0
