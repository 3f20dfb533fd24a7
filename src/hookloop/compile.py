"""``train.compile=true``: ``torch.compile`` for the training step, checkpoints kept eager.

Only the module the step runs is compiled (``torch.compile`` wraps it in an
``OptimizedModule`` that shares its parameters); the Trainer keeps the eager
module as ``trainer.model``, and that is what checkpoints save. So a checkpoint
never holds ``_orig_mod.`` keys: one written by a compiled run resumes in an
eager run and the other way round. A model handed over already compiled is
unwrapped the same way (:func:`unwrap_compiled`).

Compiling needs a backend that can build kernels on this machine: Inductor
generates C++ on CPU (a C++ compiler must be found) and Triton kernels on CUDA.
:func:`check_can_compile` asks before training starts, so a platform that
cannot compile fails at once with what is missing, not at the first step.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


class CompileUnavailable(RuntimeError):
    """``train.compile=true`` on a platform where ``torch.compile`` cannot build kernels."""


_FIX = "install what is missing, or set train.compile=false to train eagerly"


def check_can_compile(device: torch.device) -> None:
    """Raise :class:`CompileUnavailable` naming what is missing to compile for ``device``."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise CompileUnavailable(
            f"train.compile=true: torch.compile does not support Python "
            f"{sys.version.split()[0]} with torch {torch.__version__}; {_FIX}"
        )
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise CompileUnavailable(
                "train.compile=true on a CUDA device needs Triton (the 'triton' package, "
                f"matching torch {torch.__version__}), which is not importable here; {_FIX}"
            )
        return
    if device.type == "cpu":
        from torch._inductor import config as inductor_config
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception as err:
            searched = inductor_config.cpp.cxx
            raise CompileUnavailable(
                "train.compile=true on the CPU needs a C++ compiler (torch.compile's Inductor "
                f"backend builds C++ kernels); none was found (searched {searched!r}, "
                f"{type(err).__name__}). Install g++ or clang++ or point $CXX at one, or set "
                "train.compile=false to train eagerly"
            ) from err


def unwrap_compiled(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """``(eager module, compiled wrapper or None)`` for a model that may come compiled."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # never compiled: importing dynamo here would cost a second a run
        return model, None
    if isinstance(model, eval_frame.OptimizedModule):
        return model._orig_mod, model
    return model, None


def compile_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module the training step runs, compiled (parameters shared with ``module``)."""
    return torch.compile(module)  # type: ignore[return-value]  # an OptimizedModule, typed as a callable


def compile_loss(loss_fn: Any) -> Any:
    """The loss function compiled, so its element-wise parts fuse (None stays None)."""
    if loss_fn is None:
        return None
    return torch.compile(loss_fn)
