"""``train.compile=true`` on CUDA (Inductor's Triton kernels): the step runs compiled, the
checkpoint holds the eager module's keys (no ``_orig_mod.``), and it loads into an
eager model that then computes what the trained model computes."""

from __future__ import annotations

import torch
from safetensors import safe_open

from hookloop.checkpoint import load_weights
from hookloop.entry import build_trainer
from hookloop.recipes import default_config
from hookloop.recipes.gpt import GPT

assert torch.cuda.is_available(), "gpu_tests/ needs a CUDA device"

STEPS = 6


def _trainer(out, *, compile, steps=STEPS, resume=None):
    cfg = default_config("gpt-stdlib")
    for key, value in {
        "device": "cuda", "precision": "bf16", "compile": compile, "max_steps": steps,
        "log_every": 2, "eval_every": None, "eval_at_epoch_end": False, "handle_signals": False,
    }.items():  # fmt: skip
        setattr(cfg.train, key, value)
    cfg.model.n_layer = 2
    cfg.checkpoint.every = None
    return build_trainer(cfg, out_dir=out, resume=resume)


def _saved_keys(run) -> set[str]:
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    with safe_open(str(latest / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_a_compiled_cuda_runs_checkpoint_loads_into_an_eager_model(tmp_path):
    from torch._dynamo.eval_frame import OptimizedModule

    run = tmp_path / "compiled"
    trainer = _trainer(run, compile=True)
    result = trainer.train()
    assert isinstance(trainer._train_model, OptimizedModule)  # the step ran compiled
    assert result.step == STEPS and result.logs["loss"] > 0
    keys = _saved_keys(run)
    assert not [k for k in keys if "_orig_mod" in k], keys
    eager_run = tmp_path / "eager"
    _trainer(eager_run, compile=False).train()
    assert keys == _saved_keys(eager_run)  # what an eager run saves, name for name

    fresh = GPT(trainer.model.config).cuda()
    load_weights(fresh, run)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    x = torch.randint(0, 256, (4, trainer.model.config.block_size), device="cuda")
    trainer.model.eval()
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(x), trainer.model(x))

    resumed = _trainer(run, compile=False, steps=STEPS + 2, resume="auto").train()
    assert resumed.step == STEPS + 2 and resumed.logs["loss"] > 0
