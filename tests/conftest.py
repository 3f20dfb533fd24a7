"""Shared fixtures: small configs and trainers over hookloop's own test doubles, and
the session's private home: every registry and cache write lands under pytest's temp dir."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Intel's MKL (torch's CPU matrix products) picks its kernels by CPU: on a CPU with AVX-512
# a product of tiny matrices rounds differently in the last bit than on one without. The
# checkpoints in tests/data were written on a machine that computes as MKL's compatible
# path does, and the tests resume them bitwise; so every process of the suite (and every
# child it starts, which inherits this) uses that path. Set before MKL's first call.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import pytest
import torch

from _registry_guard import SESSION_MARK, Session, entries, user_registries
from hookloop import Config, Trainer
from hookloop.testing import TinyModel, ToyData


def _config(**train: Any) -> Config:
    """A Config for fast CPU runs: batch 4, no signal handlers, no logging unless asked."""
    cfg = Config()
    cfg.data.batch_size = 4
    cfg.train.device = "cpu"
    cfg.train.handle_signals = False
    cfg.train.log_every = 0
    for key, value in train.items():
        if not hasattr(cfg.train, key):
            raise AttributeError(f"TrainConfig has no field {key!r}")
        setattr(cfg.train, key, value)
    return cfg


@pytest.fixture
def make_config() -> Callable[..., Config]:
    """``make_config(max_steps=3, ...)``: TrainConfig fields as keywords."""
    return _config


@pytest.fixture
def make_trainer() -> Callable[..., Trainer]:
    """``make_trainer(callbacks=..., n=16, eval_n=None, **train_fields)``.

    TinyModel on ToyData(n) with mean-squared error; ``eval_n`` adds evaluation
    data of that many samples, ``cfg`` replaces the generated config.
    """

    def build(
        callbacks: Any = None,
        *,
        n: int = 16,
        eval_n: int | None = None,
        test_n: int | None = None,
        cfg: Config | None = None,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **train: Any,
    ) -> Trainer:
        return Trainer(
            model if model is not None else TinyModel(),
            optimizer,
            train_data=ToyData(n=n),
            eval_data=ToyData(n=eval_n, seed=1) if eval_n else None,
            test_data=ToyData(n=test_n, seed=2) if test_n else None,
            config=cfg if cfg is not None else _config(**train),
            callbacks=callbacks,
            loss_fn=TinyModel.loss_fn,
        )

    return build


# -- a private home for the session ----------------------------------------------------------

#: Where each variable points, relative to the session's private root. Subprocesses inherit
#: them: a `hookloop train` a test starts registers its control endpoint under jobs/, not in
#: the user's registry, and matplotlib, W&B, Hugging Face, torch and Hypothesis keep their
#: caches and settings under the same root.
PRIVATE_ENV = {
    "HOOKLOOP_JOBS_DIR": "jobs",
    "XDG_RUNTIME_DIR": "runtime",
    "XDG_CONFIG_HOME": "config",
    "XDG_CACHE_HOME": "cache",
    "XDG_DATA_HOME": "data",
    "XDG_STATE_HOME": "state",
    "WANDB_DIR": "wandb",
    "WANDB_CACHE_DIR": "wandb-cache",
    "WANDB_CONFIG_DIR": "wandb-config",
    "WANDB_DATA_DIR": "wandb-data",
    "MPLCONFIGDIR": "matplotlib",
    "HYPOTHESIS_STORAGE_DIRECTORY": "hypothesis",
    "HOME": "home",
}
_REGISTRY_BEFORE = pytest.StashKey[set[Path]]()
_PLACES = pytest.StashKey[list[Path]]()


def pytest_sessionstart(session: pytest.Session) -> None:
    # Before any fixture has pointed the environment elsewhere.
    places = user_registries()
    session.config.stash[_PLACES] = places
    session.config.stash[_REGISTRY_BEFORE] = entries(places)


def session_temp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temp dir of the whole test run: under pytest-xdist, the parent of each worker's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def private_home(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """Point every variable in PRIVATE_ENV into one temp dir for the whole session.

    Session-scoped so that module fixtures (which start runs before any test-level
    fixture) see it too; tests that set HOOKLOOP_JOBS_DIR or HOME themselves still win.
    At the end, fails the session if a job the tests started registered in the user's own
    job registry (tests/_registry_guard.py; a job the user started meanwhile is theirs).
    """
    places = request.config.stash.get(_PLACES, None) or user_registries()
    before = request.config.stash.get(_REGISTRY_BEFORE, None)
    if before is None:
        before = entries(places)
    temp_root = session_temp_root(tmp_path_factory)
    session = Session(temp_root=temp_root, pid=os.getpid(), mark=str(temp_root))
    root = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        for name, sub in PRIVATE_ENV.items():
            path = root / sub
            path.mkdir(mode=0o700)
            mp.setenv(name, str(path))
        mp.setenv(SESSION_MARK, session.mark)
        # A child that dies of a fatal signal (a rank's SIGABRT at exit, seen once in CI)
        # prints every thread's Python stack into the stderr a failing test shows.
        mp.setenv("PYTHONFAULTHANDLER", "1")
        yield root
    blamed = session.blamed(before, places)
    if blamed:
        pytest.fail(
            "tests wrote to the user's own job registry (each test's runs must register under "
            "$HOOKLOOP_JOBS_DIR, which the private_home fixture points into the session's "
            "temp dir):\n  " + "\n  ".join(map(str, blamed)),
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def fresh_wandb():
    """W&B keeps process-wide state: an active run the next ``wandb.init`` hands back, and
    settings (``WANDB_DIR`` …) read from the environment once, at its first set-up. Each
    test that used it ends with both torn down, so the next test's environment counts."""
    yield
    wandb = sys.modules.get("wandb")
    if wandb is None:
        return
    if getattr(wandb, "run", None) is not None:
        wandb.finish()
    if hasattr(wandb, "teardown"):
        wandb.teardown()
