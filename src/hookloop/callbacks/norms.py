"""Norms of gradients and weights, per parameter and in total, added to the logs.

- :class:`GradNormLogger`: each parameter's gradient L2 norm, as the optimizer
  is about to use it (after accumulation, unscaling and clipping), on steps
  that end with a log (``ctx.state.will_log``: scheduled by ``train.log_every``,
  or requested before the step began); keys ``grad_norm/<name>`` and
  ``grad_norm/total``.
- :class:`ParameterNormLogger`: each parameter's L2 norm (``param_norm/<name>``)
  and, for every parameter with two or more dimensions (flattened to
  ``shape[0] x rest``), its spectral norm (``spectral_norm/<name>``), the
  largest singular value, by power iteration warm-started from the previous
  estimate's singular vector.
- :class:`WeightNormLogger`: the L2 norm of all parameters together (``weight_norm``).

Norms are computed as tensors and read back with one host transfer per log
event, never on a step that is not logged. ``include`` (glob patterns over
parameter names, e.g. ``["blocks.*.attn.*"]``) narrows the parameters. The
per-parameter loggers can also append each record to a JSON Lines file
(``path``); a checkpoint remembers how far it was written, so a resumed run
does not repeat records. To compute less often, register with a filter:
``manager.add(ParameterNormLogger(), every=500)``.
"""

from __future__ import annotations

import fnmatch
import math
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hookloop.callback import Callback
from hookloop.journal import Journal
from hookloop.state import CallbackContext


def spectral_norm(
    matrix: torch.Tensor, v: torch.Tensor | None = None, iters: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest singular value of a 2-D ``matrix`` by power iteration.

    Returns ``(sigma, v)``: the estimate (a 0-dim tensor, never above the true
    value) and the right singular vector to warm-start the next call with.
    ``v`` defaults to a fixed pseudo-random unit vector.
    """
    if matrix.dim() != 2:
        raise ValueError(f"matrix must be 2-D, got shape {tuple(matrix.shape)}")
    if v is None or v.shape != (matrix.shape[1],):
        v = _start_vector(matrix.shape[1], 0, matrix.device)
    w = matrix.float()
    v = v.to(device=w.device, dtype=w.dtype)
    sigma = torch.zeros((), device=w.device)
    for _ in range(max(1, iters)):
        u = w @ v
        u = u / u.norm().clamp_min(1e-30)
        v = w.T @ u
        sigma = v.norm()
        v = v / sigma.clamp_min(1e-30)
    return sigma, v


def _start_vector(n: int, seed: int, device: torch.device) -> torch.Tensor:
    # A private generator: the global RNG (and with it exact resume) is untouched.
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g)
    return (v / v.norm()).to(device)


def _selected(
    model: torch.nn.Module | None, include: Sequence[str] | None
) -> list[tuple[str, torch.nn.Parameter]]:
    if model is None:
        return []
    return [
        (name, p)
        for name, p in model.named_parameters()
        if include is None or any(fnmatch.fnmatchcase(name, pat) for pat in include)
    ]


def _check_include(include: Sequence[str] | None) -> tuple[str, ...] | None:
    if include is None:
        return None
    if isinstance(include, str) or not all(isinstance(p, str) and p for p in include):
        raise ValueError(
            f"include must be a list of glob patterns over parameter names, got {include!r}"
        )
    return tuple(include)


def _check_path(path: str | Path | None) -> Path | None:
    if path is None:
        return None
    if not isinstance(path, (str, Path)) or not str(path):
        raise ValueError(f"path must be a file path or None, got {path!r}")
    return Path(path)


def _read_back(values: list[torch.Tensor]) -> list[float]:
    """One host transfer for a list of 0-dim tensors (per device, if they differ)."""
    try:
        return torch.stack([v.float() for v in values]).tolist()
    except RuntimeError:  # parameters on several devices
        return [float(v) for v in values]


def _on_meta(params: list[tuple[str, torch.nn.Parameter]]) -> bool:
    return bool(params) and params[0][1].device.type == "meta"


class _JsonlFile:
    """An append-only JSON Lines file whose checkpointed length survives a resume."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._journal = Journal(path)

    def write(self, record: dict[str, Any]) -> None:
        self._journal.append(record)
        self._journal.sync()

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self._journal.offset()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Cut off what was written after the checkpoint (it will be written again)."""
        self._journal.cut(int(state.get("offset", 0)))

    def close(self) -> None:
        self._journal.close()


class _PerParameterLogger(Callback):
    """What the two per-parameter loggers share: selection, the optional file, state."""

    priority = 25

    def __init__(self, include: Sequence[str] | None, path: str | Path | None) -> None:
        self.include = _check_include(include)
        self.path = _check_path(path)
        self._file = _JsonlFile(self.path) if self.path is not None else None
        self._warned_meta = False

    def _params(self, ctx: CallbackContext) -> list[tuple[str, torch.nn.Parameter]]:
        params = _selected(ctx.model, self.include)
        if _on_meta(params):
            if not self._warned_meta:
                warnings.warn(
                    f"{type(self).__name__}: the model's parameters are on the meta device "
                    "(e.g. pipeline parallelism); norms are not logged",
                    stacklevel=2,
                )
                self._warned_meta = True
            return []
        return params

    def _record(self, ctx: CallbackContext, values: dict[str, Any]) -> None:
        if self._file is not None and ctx.state.is_rank_zero:
            self._file.write({"step": ctx.state.step, "epoch": ctx.state.epoch, **values})

    def state_dict(self) -> dict[str, Any]:
        return {"file": self._file.state_dict()} if self._file is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._file is not None and "file" in state:
            self._file.load_state_dict(state["file"])

    def on_train_end(self, ctx: CallbackContext) -> None:
        if self._file is not None:
            self._file.close()

    def on_exception(self, ctx: CallbackContext) -> None:
        if self._file is not None:
            self._file.close()


class GradNormLogger(_PerParameterLogger):
    """Per-parameter gradient norms on the steps that end with a log (see the module doc).

    Captured in ``on_before_optimizer_step`` as tensors, read back in
    ``on_before_log``. Only steps the loop marks ``ctx.state.will_log`` when
    they begin are captured: scheduled log steps, and steps that begin with a
    log request pending. A log requested during the step itself comes too late
    for the gradients, so it has none. ``total`` adds
    ``<prefix>total``: the norm of all captured gradients together, after
    clipping (the loop's own ``grad_norm`` is the norm before clipping).
    """

    def __init__(
        self,
        include: Sequence[str] | None = None,
        *,
        prefix: str = "grad_norm/",
        total: bool = True,
        path: str | Path | None = None,
    ) -> None:
        super().__init__(include, path)
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix must be a non-empty string, got {prefix!r}")
        if not isinstance(total, bool):
            raise ValueError(f"total must be True or False, got {total!r}")
        self.prefix = prefix
        self.total = total
        self._names: list[str] = []
        self._norms: list[torch.Tensor] = []
        self._captured_at = -1

    def on_before_optimizer_step(self, ctx: CallbackContext) -> None:
        if not ctx.state.will_log:
            return
        params = [(n, p) for n, p in self._params(ctx) if p.grad is not None]
        if not params:
            return
        self._names = [n for n, _ in params]
        self._norms = _norms([p.grad for _, p in params])
        self._captured_at = ctx.state.step

    def on_before_log(self, ctx: CallbackContext) -> None:
        if ctx.logs is None or self._captured_at != ctx.state.step or not self._norms:
            return
        values = _read_back(self._norms)
        norms = dict(zip(self._names, values, strict=True))
        self._norms, self._captured_at = [], -1
        for name, value in norms.items():
            ctx.logs[self.prefix + name] = value
        if self.total:
            ctx.logs[self.prefix + "total"] = math.sqrt(sum(v * v for v in values))
        self._record(ctx, {"grad_norms": norms})


class ParameterNormLogger(_PerParameterLogger):
    """Per-parameter L2 and spectral norms at each log event (see the module doc).

    ``power_iters`` power-iteration steps run per matrix per call (twice as many
    the first time, with no vector to start from); the right singular vectors
    are kept between calls and in checkpoints. ``power_iter_steps`` is
    Forgather's name for ``power_iters``.
    """

    def __init__(
        self,
        include: Sequence[str] | None = None,
        *,
        log_norms: bool = True,
        log_spectral_norms: bool = True,
        power_iters: int = 10,
        path: str | Path | None = None,
        seed: int = 0,
        power_iter_steps: int | None = None,
    ) -> None:
        super().__init__(include, path)
        if power_iter_steps is not None:
            if power_iters != 10:
                raise ValueError("give power_iters or Forgather's power_iter_steps, not both")
            power_iters = power_iter_steps
        for name, value in (("log_norms", log_norms), ("log_spectral_norms", log_spectral_norms)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if isinstance(power_iters, bool) or not isinstance(power_iters, int) or power_iters < 1:
            raise ValueError(f"power_iters must be an int >= 1, got {power_iters!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.log_norms = log_norms
        self.log_spectral_norms = log_spectral_norms
        self.power_iters = power_iters
        self.seed = seed
        self.vectors: dict[str, torch.Tensor] = {}  # warm starts, by parameter name

    def on_before_log(self, ctx: CallbackContext) -> None:
        if ctx.logs is None or not (self.log_norms or self.log_spectral_norms):
            return
        params = self._params(ctx)
        keys: list[str] = []
        tensors: list[torch.Tensor] = []
        with torch.no_grad():
            if self.log_norms and params:
                keys += [f"param_norm/{name}" for name, _ in params]
                tensors += _norms([p.detach() for _, p in params])
            if self.log_spectral_norms:
                for name, p in params:
                    if p.dim() >= 2:
                        keys.append(f"spectral_norm/{name}")
                        tensors.append(self._spectral(name, p))
        if not tensors:
            return
        values = dict(zip(keys, _read_back(tensors), strict=True))
        ctx.logs.update(values)
        record: dict[str, Any] = {}
        if self.log_norms:
            record["norms"] = {
                k[len("param_norm/") :]: v for k, v in values.items() if k.startswith("param_norm/")
            }
        if self.log_spectral_norms:
            record["spectral_norms"] = {
                k[len("spectral_norm/") :]: v
                for k, v in values.items()
                if k.startswith("spectral_norm/")
            }
        self._record(ctx, record)

    def _spectral(self, name: str, p: torch.Tensor) -> torch.Tensor:
        matrix = p.detach().reshape(p.shape[0], -1)
        v = self.vectors.get(name)
        if v is None or v.shape != (matrix.shape[1],):
            v = _start_vector(matrix.shape[1], self.seed + zlib.crc32(name.encode()), p.device)
            iters = 2 * self.power_iters
        else:
            iters = self.power_iters
        sigma, self.vectors[name] = spectral_norm(matrix, v, iters)
        return sigma

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["vectors"] = {name: v.detach().cpu() for name, v in self.vectors.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        # Kept on the CPU until used; spectral_norm moves each to its parameter's device.
        self.vectors = dict(state.get("vectors", {}))


class WeightNormLogger(Callback):
    """The L2 norm of all (selected) parameters together, as ``weight_norm``.

    Rising over training usually means weight decay is too weak for the
    learning rate; steady weights with rising gradient norms point elsewhere.
    """

    priority = 25

    def __init__(self, include: Sequence[str] | None = None, *, key: str = "weight_norm") -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty metric name, got {key!r}")
        self.include = _check_include(include)
        self.key = key

    def on_before_log(self, ctx: CallbackContext) -> None:
        if ctx.logs is None:
            return
        params = _selected(ctx.model, self.include)
        if not params or _on_meta(params):
            return
        with torch.no_grad():
            norms = _read_back(_norms([p.detach() for _, p in params]))
        ctx.logs[self.key] = math.sqrt(sum(v * v for v in norms))


def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's 2-norm, as a 0-dim tensor on its device (no host read)."""
    return [torch.linalg.vector_norm(t) for t in tensors]
