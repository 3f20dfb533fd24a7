"""What a checkpoint holds: named state, serialised and restored.

The loop hands over ``{name: object with state_dict/load_state_dict}``
(:func:`save_state` / :func:`load_state`). ``model`` and ``optimizer`` get files of
their own (``model.safetensors`` and ``optimizer.pt``, or DCP shards under
``sharded/`` when FSDP2 shards the model); every other entry goes into
``trainer_state.pt`` under its name, checked first to reload with
:func:`hookloop.safeload.load` (``weights_only=True``). An entry marked
``per_rank`` (the RNG) is gathered from every rank. An entry that is
:class:`ShardedStateful` (the callbacks, for ``EMA``'s averages) also has tensors sharded
like the model: under FSDP2 every rank saves its shards of them in the same DCP save as
the model's, under ``<entry>.<part>.`` (format 4), and a load reshards them as it does
the model. Nothing here knows the Trainer: a checkpoint can be written and read with a
bare model and optimizer.

A load reads and checks everything first (:func:`read_state`) and only then applies
it (:func:`apply_state`): a file that does not load, or a ``trainer_state.pt`` that
lacks an entry every checkpoint holds or whose step is not its manifest's, is a
damaged checkpoint (:class:`CheckpointError` naming file and entry) and leaves the
live state untouched, so that ``resume="auto"`` can try an older one.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from hookloop.callback import Stateful
from hookloop.checkpoint.storage import MODEL, OPTIMIZER, SHARDED_DIR, STATE_FILE, CheckpointError
from hookloop.checkpoint.weights import device_of, load_safetensors
from hookloop.distributed import gather_objects, is_distributed, is_sharded, rank_info
from hookloop.safeload import load


class Saveable(Protocol):
    """What a save reads of a named state: a live object, or the copy of its
    ``state_dict()`` that a background save writes (:class:`~.background.Frozen`)."""

    def state_dict(self) -> Any: ...


@runtime_checkable
class ShardedStateful(Protocol):
    """State with tensors sharded like an FSDP2 model (DTensors), by part (a callback's
    name). ``sharded_state_dict(model)`` gives the tensors to save, or to load into in
    place (the same placement as the parameters); ``load_sharded_state_dict`` takes
    the parts the checkpoint held, after the entry's ``load_state_dict``."""

    def sharded_state_dict(self, model: torch.nn.Module) -> dict[str, Any]: ...

    def load_sharded_state_dict(self, parts: dict[str, Any]) -> None: ...


class RNGState:
    """Every RNG of this process (Python, NumPy, torch, CUDA), as a named state.

    ``per_rank``: each rank's own state is saved, so a resumed multi-rank run
    draws the same dropout masks on every rank.

    ``hold``: a loaded state is kept (``held``) instead of applied, until :meth:`release`:
    transformers' Trainer restores its generators only after it has fetched the first
    batches of a resumed epoch, and its dialect does the same.
    """

    per_rank = True

    def __init__(self) -> None:
        self.hold = False
        self.held: dict[str, Any] | None = None

    def release(self) -> None:
        """Apply the state held back (nothing when none is)."""
        held, self.held = self.held, None
        if held is not None:
            _set_rng_state(held)

    def state_dict(self) -> dict[str, Any]:
        return _rng_state()

    @staticmethod
    def for_rank(saved: dict[str, Any], rank: int) -> dict[str, Any]:
        """The RNG state of ``rank`` in a resume on another number of ranks than the
        checkpoint's: drawn from rank 0's saved torch state and the rank number, so every
        rank gets its own streams and a second such resume gets the same ones. (The
        dropout masks after a change of world size follow the new layout, not the old.)"""
        torch_state = saved["torch"]
        digest = hashlib.blake2b(bytes(torch_state.numpy()), digest_size=8, key=b"hookloop-rng")
        digest.update(rank.to_bytes(8, "little"))
        seed = int.from_bytes(digest.digest(), "little") >> 1
        np_state = np.random.RandomState(seed % 2**32).get_state(legacy=True)
        assert isinstance(np_state, tuple), "a RandomState is always MT19937"
        derived: dict[str, Any] = {
            "python": random.Random(seed).getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
            "torch": torch.Generator().manual_seed(seed).get_state(),
        }
        if "cuda" in saved:
            derived["cuda"] = saved["cuda"]  # reseeded below, per device, from the same seed
            derived["cuda_seed"] = seed
        return derived

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.hold:
            self.held = state
        else:
            _set_rng_state(state)


class DictState:
    """A plain dict (``user_state``) as a named state: restored in place."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def state_dict(self) -> dict[str, Any]:
        return self.data

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.clear()
        self.data.update(state)


class CallbackStates:
    """Stateful callbacks, keyed by name, as one named state.

    A saved state without a live callback, or a live one without saved state,
    is a warning (it starts fresh), or a :class:`CheckpointError` when ``strict``.
    """

    def __init__(self, callbacks: Mapping[str, Stateful], *, strict: bool = False) -> None:
        self.callbacks = callbacks
        self.strict = strict

    def state_dict(self) -> dict[str, Any]:
        return {name: cb.state_dict() for name, cb in self.callbacks.items()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        problems = [
            f"saved state for callback {name!r} has no matching callback"
            for name in saved
            if name not in self.callbacks
        ]
        problems += [
            f"stateful callback {name!r} has no saved state (it starts fresh)"
            for name in self.callbacks
            if name not in saved
        ]
        if problems and self.strict:
            raise CheckpointError("callback state mismatch at resume: " + "; ".join(problems))
        for name, state in saved.items():
            if name in self.callbacks:
                self.callbacks[name].load_state_dict(state)
        for problem in problems:
            warnings.warn(f"hookloop resume: {problem}", stacklevel=4)

    def sharded_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The sharded state of each callback that has one (``EMA`` under FSDP2), by name."""
        return {
            name: state
            for name, cb in self.callbacks.items()
            if isinstance(cb, ShardedStateful)
            if (state := cb.sharded_state_dict(model))
        }

    def load_sharded_state_dict(self, parts: dict[str, Any]) -> None:
        for name, state in parts.items():
            callback = self.callbacks[name]
            assert isinstance(callback, ShardedStateful), "parts come from sharded_state_dict"
            callback.load_sharded_state_dict(state)


def save_state(
    state: Mapping[str, Saveable], staging: Path
) -> tuple[dict[str, bytes], list[Path]] | None:
    """Serialise ``state``; every rank calls it. Rank 0 gets the files to commit.

    Returns ``(files, written)`` on rank 0 (``written``: directories other ranks
    wrote into ``staging``, i.e. DCP shards) and None elsewhere. Every rank takes
    part: per-rank entries are gathered, and a sharded model is written by all.
    """
    model, optimizer = state[MODEL], state[OPTIMIZER]
    per_rank = {
        name: _gather_bytes(obj.state_dict())
        for name, obj in state.items()
        if getattr(obj, "per_rank", False)
    }
    written = []
    if holds_sharded_model(state):
        sharded = model_of(state)
        extra = {
            name: parts
            for name, obj in state.items()
            if name not in (MODEL, OPTIMIZER) and isinstance(obj, ShardedStateful)
            if (parts := obj.sharded_state_dict(sharded))
        }
        save_sharded(sharded, sharded_optimizer(optimizer), staging / SHARDED_DIR, extra=extra)
        written.append(staging / SHARDED_DIR)
    if rank_info()[0] != 0:
        return None
    files = {} if written else _full_weights(model, optimizer, staging)
    saved: dict[str, Any] = {}
    for name, obj in state.items():
        if name in (MODEL, OPTIMIZER):
            continue
        if name in per_rank:
            saved[name], saved[f"{name}_per_rank"] = per_rank[name][0], per_rank[name]
        else:
            saved[name] = _portable(obj.state_dict(), name)
    files[STATE_FILE] = torch_bytes(saved)
    return files, written


#: Entries of ``trainer_state.pt`` that every checkpoint of a run holds (format 1 on): when
#: the loop expects one and the file lacks it, the checkpoint is damaged. Without them a
#: resume would silently start its counters, data order or randomness over.
REQUIRED_ENTRIES = ("train_state", "data", "rng", "user_state", "callbacks")


@dataclass
class SavedState:
    """A checkpoint read into memory and checked, not yet applied."""

    path: Path
    optimizer: dict[str, Any] | None  # None: model and optimizer are DCP shards
    entries: dict[str, Any]
    shard_keys: frozenset[str] = frozenset()  # the keys of the DCP shards, when sharded


def load_state(state: Mapping[str, Stateful], path: Path, *, step: int | None = None) -> None:
    """Restore ``state`` from the checkpoint directory ``path`` (verified by the caller)."""
    apply_state(state, read_state(state, path, step=step))


def read_state(state: Mapping[str, Stateful], path: Path, *, step: int | None = None) -> SavedState:
    """Read the checkpoint at ``path`` for ``state`` and check it; nothing is applied yet.

    Raises :class:`CheckpointError` naming the file (and entry) when a file does not
    load, an entry the loop expects and every checkpoint holds is missing, or the saved
    ``train_state`` is not at ``step`` (the manifest's). Entries outside
    :data:`REQUIRED_ENTRIES` that the checkpoint does not hold (a scheduler added since)
    keep their current state.
    """
    model = model_of(state)
    sharded_checkpoint = (path / SHARDED_DIR).is_dir()
    if is_sharded(model) != sharded_checkpoint:
        saved, running = ("sharded", "full") if sharded_checkpoint else ("full", "sharded")
        raise CheckpointError(
            f"checkpoint {path} holds {saved} weights but this run's model is {running}: "
            "resume with the train.parallel and number of ranks it was saved with ('fsdp' "
            "with several ranks saves sharded weights, anything else full ones)"
        )
    optimizer, shard_keys = None, frozenset[str]()
    if sharded_checkpoint:
        shard_keys = _shard_keys(path / SHARDED_DIR)
    else:
        optimizer = _load_file(path / "optimizer.pt", device_of(model))
    entries = _load_file(path / STATE_FILE, torch.device("cpu"))
    _check_entries(entries, state, path / STATE_FILE, step)
    return SavedState(path, optimizer, entries, shard_keys)


def apply_state(state: Mapping[str, Stateful], saved: SavedState) -> None:
    """Put a checkpoint read by :func:`read_state` into the live objects."""
    model, optimizer = model_of(state), state[OPTIMIZER]
    extra: dict[str, dict[str, Any]] = {}
    if saved.optimizer is None:
        extra = _saved_parts(state, model, saved.shard_keys)
        load_sharded(model, sharded_optimizer(optimizer), saved.path / SHARDED_DIR, extra=extra)
    else:
        load_safetensors(bare_model(model), saved.path / "model.safetensors")
        optimizer.load_state_dict(saved.optimizer)
    rank, _, world_size = rank_info()
    entries = saved.entries
    for name, obj in state.items():
        if name in (MODEL, OPTIMIZER) or entries.get(name) is None:
            continue
        value = entries[name]
        if getattr(obj, "per_rank", False):
            value = _own_share(entries, name, rank, world_size)
        obj.load_state_dict(value)
    for name, parts in extra.items():  # after the plain state, which they complete
        obj = state[name]
        assert isinstance(obj, ShardedStateful), "parts come from sharded_state_dict"
        obj.load_sharded_state_dict(parts)


def _saved_parts(
    state: Mapping[str, Stateful], model: torch.nn.Module, keys: frozenset[str]
) -> dict[str, dict[str, Any]]:
    """The sharded parts of ``state`` that the checkpoint holds (a callback added since,
    or a checkpoint of format 3 or older, has none), as tensors to load into."""
    extra = {}
    for name, obj in state.items():
        if name not in (MODEL, OPTIMIZER) and isinstance(obj, ShardedStateful):
            parts = obj.sharded_state_dict(model)
            held = {
                part: value
                for part, value in parts.items()
                if any(key.startswith(f"{name}.{part}.") for key in keys)
            }
            if held:
                extra[name] = held
    return extra


def _shard_keys(directory: Path) -> frozenset[str]:
    """The keys a DCP checkpoint holds (its ``.metadata``), to load only what it has."""
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except Exception as err:  # a truncated or foreign .metadata
        raise CheckpointError(
            f"checkpoint file {directory / '.metadata'} cannot be loaded "
            f"({type(err).__name__}: {str(err)[:200]})"
        ) from None
    return frozenset(metadata.state_dict_metadata)


def _load_file(fpath: Path, device: torch.device) -> Any:
    """A torch file of a checkpoint; one that does not load is a damaged checkpoint."""
    try:
        return torch_load(fpath, device)
    except Exception as err:  # an unpickler refusal, a truncated zip, a wrong type
        reason = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
        raise CheckpointError(
            f"checkpoint file {fpath} cannot be loaded ({type(err).__name__}: {reason[:200]})"
        ) from None


def _check_entries(
    entries: Any, state: Mapping[str, Stateful], fpath: Path, step: int | None
) -> None:
    """``trainer_state.pt`` holds what the loop expects, at the manifest's step."""
    if not isinstance(entries, dict):
        raise CheckpointError(
            f"checkpoint file {fpath} is damaged: it holds a {type(entries).__name__}, "
            "not the dict of named state a checkpoint saves"
        )
    for name in state:
        if name in REQUIRED_ENTRIES and name not in entries:
            raise CheckpointError(
                f"checkpoint file {fpath} is damaged: it has no {name!r} entry, which every "
                f"checkpoint holds (it holds: {', '.join(sorted(map(str, entries))) or 'nothing'})"
            )
    if "train_state" in state and "train_state" in entries:
        saved = entries["train_state"]
        saved_step = saved.get("step") if isinstance(saved, dict) else None
        if not isinstance(saved_step, int) or (step is not None and saved_step != step):
            raise CheckpointError(
                f"checkpoint file {fpath} is damaged: its 'train_state' entry is at step "
                f"{saved_step!r}, its manifest at step {step}"
            )


def _own_share(saved: dict[str, Any], name: str, rank: int, world_size: int) -> Any:
    per_rank = saved.get(f"{name}_per_rank") or []
    if len(per_rank) == world_size and rank < len(per_rank):
        return per_rank[rank]
    if name == "rng" and (world_size > 1 or len(per_rank) > 1):
        return RNGState.for_rank(saved[name], rank)  # another number of ranks: derived
    if world_size > 1:
        warnings.warn(
            f"hookloop resume: checkpoint saved with {len(per_rank) or 1} rank(s), running "
            f"with {world_size}; every rank restores rank 0's {name} state",
            stacklevel=4,
        )
    return saved[name]


def _gather_bytes(value: Any) -> list[Any]:
    """Every rank's ``value`` (as bytes: object collectives do not carry tensors reliably)."""
    if not is_distributed():
        return [value]
    return [torch_loads(b) for b in gather_objects(torch_bytes(value))]


def _full_weights(model: Saveable, optimizer: Saveable, scratch_dir: Path) -> dict[str, bytes]:
    from safetensors.torch import save_model

    tmp = scratch_dir.parent / f".model-{os.getpid()}.tmp"
    if isinstance(model, torch.nn.Module):
        model = bare_model(model)
    # save_model handles tied weights; it reads only state_dict(), which a Frozen copy has too
    save_model(model, str(tmp))  # type: ignore[arg-type]  # a Frozen copy is no Module
    model_bytes = tmp.read_bytes()
    tmp.unlink()
    return {"model.safetensors": model_bytes, "optimizer.pt": torch_bytes(optimizer.state_dict())}


def save_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    directory: Path,
    *,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Every rank writes its shards of model and optimizer into ``directory`` (DCP, fsynced),
    and of the ``extra`` entries (sharded state by name, beside ``model`` and ``optimizer``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save(
        {**(extra or {}), "model": model_state, "optimizer": optim_state},
        storage_writer=dcp.FileSystemWriter(directory, sync_files=True),
    )


def load_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    directory: Path,
    *,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Every rank reads its shards of model and optimizer from ``directory`` (DCP), and
    of the ``extra`` entries, in place into the tensors they hold."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {**(extra or {}), "model": model_state, "optimizer": optim_state}
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    except dcp.CheckpointException as err:
        raise CheckpointError(
            f"{directory} does not fit the sharded model and optimizer: {err}"
        ) from None
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple), "the global RandomState is always MT19937"
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # unannotated in torch
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
        if "cuda_seed" in state:  # derived for another number of ranks (RNGState.for_rank)
            torch.cuda.manual_seed_all(state["cuda_seed"])


def bare_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DDP wrapper (any other model as it is)."""
    inner = getattr(model, "module", model)
    return inner if isinstance(inner, torch.nn.Module) else model


def holds_sharded_model(state: Mapping[str, Saveable]) -> bool:
    """Whether the named state's model is sharded by FSDP2 (a copy of one never is)."""
    model = state[MODEL]
    return isinstance(model, torch.nn.Module) and is_sharded(model)


def model_of(state: Mapping[str, Saveable]) -> torch.nn.Module:
    """The live model among the named state (the one a load restores)."""
    model = state[MODEL]
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"checkpoint state {MODEL!r} must be a torch.nn.Module, got {type(model).__name__}"
        )
    return model


def sharded_optimizer(optimizer: Saveable) -> torch.optim.Optimizer:
    """The optimizer of a sharded model: DCP reads its parameter groups, not only its state."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "a sharded model's checkpoint needs a torch.optim.Optimizer, "
            f"got {type(optimizer).__name__}"
        )
    return optimizer


def _portable(value: Any, what: str) -> Any:
    """Check that ``value`` reloads with ``weights_only=True``; raise naming ``what`` if not.

    When a dict fails, the first entry that fails is named (``callbacks['Patience']``).
    """
    try:
        torch_loads(torch_bytes(value))
    except Exception as err:
        if isinstance(value, dict):
            for key, item in value.items():
                _portable(item, f"{what}[{key!r}]")
        raise CheckpointError(
            f"{what} cannot be checkpointed safely: it must hold only tensors, numbers, "
            f"strings, bools, None, lists, tuples and dicts ({err})"
        ) from None
    return value


def torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def torch_loads(data: bytes) -> Any:
    """What :func:`torch_bytes` wrote (the whole bytes are the cap: nothing inflates)."""
    return load(data, map_location=None)


def torch_load(path: Path, device: torch.device) -> Any:
    """A checkpoint's torch file. No cap beyond the file's size: the run wrote it, a
    model's optimizer state is as large as the model, and stored zip entries take no
    more memory than the file does on disk."""
    return load(path, map_location=device)
