"""HF's ``checkpoint-N`` folder beside hookloop's checkpoint, in the transformers dialect.

transformers (and the scripts written for it) rewrite files of a ``checkpoint-N`` folder
in place: ``torch.save(state, folder / "optimizer.pt")`` opens the path with ``"wb"``,
a script opening ``model.safetensors`` with ``"wb"`` the same. When the folder
hard-linked hookloop's files, each such write reached hookloop's checkpoint too. Each
test first writes what transformers writes, then resumes from hookloop's checkpoint.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from safetensors.torch import save  # noqa: E402

from hookloop.compat import hf  # noqa: E402
from hookloop.compat.hf import layout  # noqa: E402
from test_hf_training_differential import (  # noqa: E402
    BASE,
    RegressionDataset,
    RegressionModel,
    one_thread,  # noqa: F401 - the module's autouse fixture: tiny models, one thread
)


def _trainer(out: Path) -> Any:
    settings = {**BASE, "per_device_train_batch_size": 4, "max_steps": 4,
                "save_strategy": "steps", "save_steps": 2}  # fmt: skip
    args = transformers.TrainingArguments(output_dir=str(out), **settings)
    return hf.Trainer(RegressionModel(), args, train_dataset=RegressionDataset(32))


def _losses(trainer: Any) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def _digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


@pytest.mark.parametrize(
    "rewrite",
    ["optimizer.pt", "model.safetensors", "trainer_state.pt"],
)
def test_a_file_rewritten_in_the_hf_folder_leaves_the_hookloop_checkpoint_resumable(
    tmp_path: Path, rewrite: str
):
    whole = _trainer(tmp_path / "whole")
    whole.train()
    run = _trainer(tmp_path / "run")
    run.train()
    folder = tmp_path / "run" / "checkpoint-2"
    native = Path(layout.native_checkpoint(folder))
    assert native != folder and (folder / rewrite).is_file()
    before = _digests(native)
    target = folder / rewrite
    if rewrite == "model.safetensors":  # a script writing the weights through the path
        with open(target, "wb") as f:
            f.write(save({"hidden.weight": torch.zeros(8, 2)}))
    else:  # as transformers' Trainer saves its state files: torch.save to the path
        torch.save({"state": {}, "param_groups": []}, target)
    assert _digests(native) == before, f"writing {target} changed {native}"
    resumed = _trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(native))
    assert {s: _losses(resumed)[s] for s in (3, 4)} == {s: _losses(whole)[s] for s in (3, 4)}
    for name, value in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name  # bitwise


@pytest.mark.parametrize("kernel_copy", [True, False], ids=["copy_file_range", "plain copy"])
def test_the_folder_holds_copies_of_the_hookloop_files_not_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel_copy: bool
):
    import os

    if not kernel_copy:  # as on macOS, where os has no copy_file_range
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    _trainer(tmp_path).train()
    folder = tmp_path / "checkpoint-2"
    native = Path(layout.native_checkpoint(folder))
    for name, digest in _digests(native).items():
        if name == "manifest.json":  # the folder's own names the folder
            continue
        assert _digests(folder)[name] == digest, name
        assert (native / name).stat().st_nlink == 1, name
        assert not os.path.samefile(native / name, folder / name), name
