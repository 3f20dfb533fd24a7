"""``train.compile=true``: a compiled step, eager checkpoints, a clear error where it cannot.

Compiling is slow on a CPU (Inductor builds C++), so one tiny model is compiled
once per module and shared; the slow tests are marked.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from torch import nn

from hookloop import Config, Trainer
from hookloop.compile import CompileUnavailable
from hookloop.config import TrainConfig

STEPS = 4
BATCHES = 6  # one epoch of data for every run: a resume at step STEPS goes on in it


def _data(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(n)]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _trainer(*, compile, steps, out_dir=None, resume=None, model=None):
    model = model if model is not None else _model()
    config = Config(
        train=TrainConfig(
            max_steps=steps,
            log_every=1,
            compile=compile,
            handle_signals=False,
            device="cpu",
        )
    )
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        train_data=_data(BATCHES),
        loss_fn=nn.MSELoss(),
        config=config,
        out_dir=out_dir,
        resume=resume,
    )


def _saved_keys(run_dir):
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    with safe_open(str(latest / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_a_platform_without_a_cpp_compiler_gets_a_clear_error_at_construction():
    from torch._inductor import config as inductor_config

    # Inductor searches exactly these names for its C++ compiler: none of them exists.
    with (
        inductor_config.patch({"cpp.cxx": ("hookloop-no-such-c++",)}),
        pytest.raises(CompileUnavailable) as info,
    ):
        _trainer(compile=True, steps=1)
    message = str(info.value)
    assert "needs a C++ compiler" in message and "hookloop-no-such-c++" in message
    assert "train.compile=false" in message


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory):
    """One compiled run of STEPS steps that saves at its end."""
    run_dir = tmp_path_factory.mktemp("compiled") / "run"
    trainer = _trainer(compile=True, steps=STEPS, out_dir=run_dir)
    result = trainer.train()
    return run_dir, trainer, result


@pytest.mark.slow
def test_compiled_training_runs_the_compiled_module_and_matches_eager(compiled_run):
    _, trainer, result = compiled_run
    from torch._dynamo.eval_frame import OptimizedModule

    assert isinstance(trainer.parts.train_model, OptimizedModule)
    assert not isinstance(trainer.model, OptimizedModule)  # what users and checkpoints see
    eager = _trainer(compile=False, steps=STEPS).train()
    assert result.logs["loss"] == pytest.approx(eager.logs["loss"], rel=1e-5)


@pytest.mark.slow
def test_a_compiled_runs_checkpoint_has_no_orig_mod_keys_and_resumes_eagerly(compiled_run):
    run_dir, _, _ = compiled_run
    assert _saved_keys(run_dir) == set(_model().state_dict())
    resumed = _trainer(compile=False, steps=STEPS + 2, out_dir=run_dir, resume="auto")
    result = resumed.train()
    uninterrupted = _trainer(compile=False, steps=STEPS + 2).train()
    assert result.step == STEPS + 2
    assert result.logs["loss"] == pytest.approx(uninterrupted.logs["loss"], rel=1e-4)


@pytest.mark.slow
def test_an_eager_checkpoint_resumes_compiled_and_a_model_given_compiled_saves_eager(tmp_path):
    run_dir = tmp_path / "run"
    given = torch.compile(_model())  # handed over compiled, trained eagerly configured
    trainer = _trainer(compile=False, steps=2, out_dir=run_dir, model=given)
    assert trainer.model is given._orig_mod and trainer.parts.train_model is given
    trainer.train()
    assert _saved_keys(run_dir) == set(_model().state_dict())
    result = _trainer(compile=True, steps=3, out_dir=run_dir, resume="auto").train()
    assert result.step == 3 and result.logs["loss"] > 0
