"""Asynchronous checkpoints on CUDA: run on a machine with a GPU (`pytest gpu_tests`);
the CPU suite in tests/ never collects this folder."""

from __future__ import annotations

import torch

from hookloop.checkpoint.background import HostCopy
from hookloop.testing import TinyModel

assert torch.cuda.is_available(), "gpu_tests/ needs a CUDA device"


def test_gpu_state_is_copied_into_pinned_buffers_reused_across_saves():
    model = TinyModel().cuda()
    copier = HostCopy()
    first = copier({"model": model})["model"].state_dict()
    for key, value in model.state_dict().items():
        assert first[key].is_pinned() and torch.equal(first[key], value.cpu())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    second = copier({"model": model})["model"].state_dict()
    for key, value in model.state_dict().items():
        assert second[key].data_ptr() == first[key].data_ptr()  # the same buffer, refilled
        assert torch.equal(second[key], value.cpu())
