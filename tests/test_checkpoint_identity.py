"""A checkpoint is what its directory says it is: a flipped bit in a manifest, a manifest
that is not JSON, a trainer_state.pt without its entries or that does not load never
silently rewinds a run; each checkpoint skipped is named, and retention keeps the newer ones.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from _resign import Opaque, resign
from hookloop.checkpoint import (
    MANIFEST,
    STATE_FILE,
    CheckpointError,
    CheckpointManager,
    DictState,
    SavePolicy,
    check_manifest,
    resolve_checkpoint,
)
from hookloop.testing import TinyModel

STEPS = (10, 20, 30)


def _state(seed: int, step: int = 0) -> dict[str, Any]:
    model = TinyModel(seed=seed)
    return {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "train_state": DictState({"step": step}),
        "data": DictState({"position": step}),
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A checkpoints root holding steps 10, 20 and 30 (weights seeded by the step)."""
    root = tmp_path_factory.mktemp("identity") / "checkpoints"
    manager = CheckpointManager(root, SavePolicy(keep_last=None))
    for step in STEPS:
        manager.save(_state(step, step), step=step, epoch=0)
    return root


@pytest.fixture
def root(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "checkpoints"))


def _manifest(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}" / MANIFEST


def _resume(root: Path, policy: SavePolicy | None = None) -> tuple[int, list[str], Any]:
    """Resume "auto" into fresh state: (the step restored, the warnings, the manager)."""
    manager = CheckpointManager(root, policy or SavePolicy(keep_last=None))
    fresh = _state(99)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = manager.load("auto", fresh)
    assert path is not None
    restored = fresh["train_state"].data["step"]
    assert path.name == f"step-{restored:08d}"
    expected = TinyModel(seed=restored).state_dict()
    for key, value in fresh["model"].state_dict().items():
        assert torch.equal(value, expected[key]), key
    return restored, [str(w.message) for w in caught], manager


def test_a_flipped_step_in_an_old_manifest_neither_rewinds_the_resume_nor_loses_a_checkpoint(
    root,
):
    # The case: "step": 10 -> 90 in step-00000010/manifest.json.
    path = _manifest(root, 10)
    path.write_text(path.read_text().replace('"step": 10', '"step": 90'))
    step, said, manager = _resume(root, SavePolicy(keep_last=2))
    assert step == 30 and said == []  # the newest, intact, without a word to say

    manager.save(_state(40, 40), step=40, epoch=0)  # retention by the names' steps
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000030", "step-00000040"]
    step, _, _ = _resume(root)
    assert step == 40


@pytest.mark.parametrize("fmt", [1, 2])
def test_a_manifest_whose_step_is_not_its_directorys_is_damaged_even_re_signed(root, fmt):
    ckpt = root / "step-00000030"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["step"] = 90
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    resign(ckpt, fmt=fmt)  # the checksum matches: the directory name still disagrees
    with pytest.raises(CheckpointError, match="says step 90 but the directory holds step 30"):
        CheckpointManager(root, SavePolicy()).storage.verify(ckpt)
    step, said, _ = _resume(root)
    assert step == 20
    assert len(said) == 1 and "skipping damaged checkpoint step-00000030" in said[0]
    assert "(the one 'latest' names)" in said[0]


def test_any_changed_field_of_a_manifest_fails_its_checksum(root):
    path = _manifest(root, 30)
    manifest = json.loads(path.read_text())
    manifest["epoch"] = 1
    with pytest.raises(CheckpointError, match="checksum does not match its fields"):
        check_manifest(manifest, path)


@pytest.mark.parametrize("text", ["{not json", "null", ""], ids=["not-json", "null", "empty"])
def test_the_newest_checkpoint_with_an_unreadable_manifest_is_named_as_skipped(root, text):
    _manifest(root, 30).write_text(text)
    step, said, _ = _resume(root)
    assert step == 20
    assert len(said) == 1 and "skipping damaged checkpoint step-00000030" in said[0]


def _rewrite_trainer_state(ckpt: Path, edit) -> None:
    entries = torch.load(ckpt / STATE_FILE, weights_only=True)
    edit(entries)
    torch.save(entries, ckpt / STATE_FILE)
    resign(ckpt)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda e: e.clear(), "no 'train_state' entry"),
        (lambda e: e.pop("data"), "no 'data' entry"),
        (lambda e: e.update(train_state={"step": 0}), "'train_state' entry is at step 0"),
        (lambda e: e.update(train_state={}), "'train_state' entry is at step None"),
    ],
    ids=["no-entries", "no-data", "other-step", "no-step"],
)
def test_a_trainer_state_without_its_entries_is_damaged_not_a_restart_at_step_0(root, edit, words):
    ckpt = root / "step-00000030"
    _rewrite_trainer_state(ckpt, edit)  # and the manifest re-signed: only the content tells
    live = _state(5, 5)
    before = {k: v.clone() for k, v in live["model"].state_dict().items()}
    with pytest.raises(CheckpointError, match=words) as err:
        CheckpointManager(root, SavePolicy()).load(str(ckpt), live)
    assert str(ckpt / STATE_FILE) in str(err.value)
    for key, value in live["model"].state_dict().items():  # nothing was applied
        assert torch.equal(value, before[key]), key
    assert live["train_state"].data == {"step": 5}

    step, said, _ = _resume(root)  # auto: the previous intact checkpoint, the skip named
    assert step == 20
    assert len(said) == 1 and words in said[0] and "step-00000030" in said[0]


def test_a_trainer_state_torch_refuses_to_unpickle_is_damaged_and_auto_falls_back(root):
    ckpt = root / "step-00000030"
    torch.save({"train_state": {"step": 30}, "x": Opaque()}, ckpt / STATE_FILE)
    resign(ckpt)
    with pytest.raises(CheckpointError, match=r"trainer_state\.pt cannot be loaded") as err:
        CheckpointManager(root, SavePolicy()).load(str(ckpt), _state(1))
    assert "\n" not in str(err.value)
    step, said, _ = _resume(root)
    assert step == 20 and "cannot be loaded" in said[0]


def test_a_legacy_format_1_checkpoint_still_verifies(root):
    ckpt = root / "step-00000030"
    resign(ckpt, fmt=1)
    assert CheckpointManager(root, SavePolicy()).storage.verify(ckpt)["format"] == 1
    assert _resume(root)[0] == 30


@pytest.mark.parametrize("fmt", [2, 3])
def test_checkpoints_of_formats_2_and_3_still_resume(root, fmt):
    # format 4 added callbacks' shards to sharded checkpoints: older ones simply have none
    ckpt = root / "step-00000030"
    resign(ckpt, fmt=fmt)
    assert CheckpointManager(root, SavePolicy()).storage.verify(ckpt)["format"] == fmt
    assert _resume(root)[0] == 30


@pytest.mark.parametrize("pointer", ["", "../../etc", "\n"], ids=["empty", "outside", "blank"])
def test_a_latest_that_names_no_checkpoint_is_refused_by_name_not_called_a_torn_save(root, pointer):
    (root / "latest").write_text(pointer)
    with pytest.raises(CheckpointError, match=r"latest (is empty|does not name)") as err:
        resolve_checkpoint(root.parent)
    assert "torn" not in str(err.value) and "--resume auto" in str(err.value)
    assert _resume(root)[0] == 30  # auto needs no pointer


def test_a_latest_naming_a_missing_checkpoint_is_said(root):
    (root / "latest").write_text("step-00000040")
    step, said, _ = _resume(root)
    assert step == 30
    assert len(said) == 1 and "'latest' names step-00000040" in said[0]
