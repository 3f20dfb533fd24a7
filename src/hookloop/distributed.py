"""Rank helpers, the agreement of control decisions, and how the model is parallelised.

Every decision that changes control flow (stop, abort, save, evaluate, log,
skip) is computed locally, agreed with one small collective, then acted on by
every rank alike, so no rank waits forever in a collective the others skipped.

``train.parallel`` picks what the training step runs (:func:`parallelize`):
``ddp`` wraps the model in DistributedDataParallel, ``fsdp`` shards it in place
with FSDP2 (its parameters become DTensors, each rank holding one slice), and
``local`` leaves it alone (no per-step gradient sync, e.g. for DiLoCo).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from hookloop.errors import ConfigError


def _dtensor_class() -> type | None:
    """``DTensor`` if torch's DTensor module is loaded, else None (then no tensor is one).

    Importing ``torch.distributed.tensor`` costs about a second at start-up, and only
    sharded runs need it: a DTensor cannot exist before its module has been imported.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_info() -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` of this process (``(0, 0, 1)`` when alone)."""
    if is_distributed():
        return dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0)), dist.get_world_size()
    return 0, 0, 1


def rank_zero_only(fn: Callable[..., T]) -> Callable[..., T | None]:
    """Run ``fn`` on rank 0 only (files, printing, servers); other ranks get None."""

    def wrapper(*args: Any, **kwargs: Any) -> T | None:
        if rank_info()[0] == 0:
            return fn(*args, **kwargs)
        return None

    wrapper.__wrapped__ = fn
    return wrapper


def agree_flags(flags: list[int], device: torch.device | None = None) -> list[int]:
    """Element-wise OR of small integer flags over all ranks (max for codes).

    The flags travel in a host-memory buffer over gloo (:func:`control_group`) and are
    read back through a NumPy view of it: the agreement never waits on a GPU, however
    the model trains. (``device`` is accepted for callers of old; it is not used.)"""
    if not is_distributed():
        return flags
    group = control_group()
    tensor, view = _control_buffer(len(flags))
    view[:] = flags
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return view.tolist()


#: The agreement's group and buffers, for the process group they were made under.
_CONTROL: dict[str, Any] = {"world": None, "group": None, "buffers": {}}


def control_group() -> Any:
    """The group control flags are all-reduced over: the default one when it speaks gloo
    (CPU training, or ``"cpu:gloo,cuda:nccl"``), else a gloo group of the same ranks, made
    on the first agreement of the process group (every rank reaches that at the same
    point, as it must for a group to be made). Made again for a new process group."""
    world = dist.group.WORLD
    if _CONTROL["world"] is not world:
        backend = str(dist.get_backend())
        group = None if "gloo" in backend else dist.new_group(backend="gloo")
        _CONTROL.update(world=world, group=group, buffers={})
    return _CONTROL["group"]


def _control_buffer(length: int) -> tuple[torch.Tensor, Any]:
    """A reused int64 host buffer of ``length`` and a NumPy view of its memory."""
    buffers = _CONTROL["buffers"]
    if length not in buffers:
        tensor = torch.zeros(length, dtype=torch.int64)
        buffers[length] = (tensor, tensor.numpy())
    return buffers[length]


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a copy; the input is unchanged)."""
    if is_distributed():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (a copy)."""
    if is_distributed():
        return all_reduce_sum(value) / dist.get_world_size()
    return value


def init_from_env() -> bool:
    """Join the process group torchrun describes in the environment (once).

    Uses nccl when CUDA is available, gloo otherwise. Returns whether this
    process is part of a group of more than one.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or is_distributed():
        return is_distributed()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    store = _attempt_store(world)
    if store is None:
        dist.init_process_group(backend=backend)
    else:
        rank = int(os.environ["RANK"])
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world)
    return True


def _attempt_store(world: int) -> Any:
    """The store of this torchrun attempt, or None to let torch connect as it does.

    torchrun's agent keeps one rendezvous store for the whole job and its workers
    use it without a per-attempt namespace (pytorch/pytorch#135712), so after an
    elastic restart a rank can read the address a dead rank of the previous
    attempt published and fail (or hang) connecting to it. With a single agent
    (``GROUP_WORLD_SIZE`` 1) every worker sees the same ``TORCHELASTIC_RESTART_COUNT``,
    so each attempt gets keys of its own. Several agents keep their own counts;
    there ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store each round) is
    the fix, set where torchrun is started (see the README).
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("GROUP_WORLD_SIZE") != "1":
        return None
    shared = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world_size=world,
        is_master=False,
        timeout=dist.distributed_c10d.default_pg_timeout,
    )
    return dist.PrefixStore(
        f"hookloop/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", shared
    )


def leave_process_group(*, wait: bool = True) -> None:
    """Wait for every rank, then destroy the default process group (if there is one).

    For the end of a run that every rank reached: destroying the group while a
    peer is still in a collective can kill that peer. ``wait=False`` is for an
    error path, where peers may never reach a barrier; leaving the group alive
    at exit instead lets gloo's threads abort the process (SIGABRT).
    """
    if not is_distributed():
        return
    if wait:
        dist.barrier()
    store, world = _default_store(), dist.get_world_size()
    dist.destroy_process_group()
    if wait and store is not None:
        _exit_barrier(store, world)


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _exit_barrier(store: Any, world: int, timeout: float = 30.0) -> None:
    """Wait (bounded) until every rank has destroyed its group, before this one exits.

    A rank that exits while a peer is still tearing its gloo group down can take
    that peer with it ("terminate called without an active exception", SIGABRT),
    seen in loaded test runs. The rendezvous store outlives the group.
    """
    try:
        store.add("hookloop/left", 1)
        deadline = time.monotonic() + timeout
        while store.add("hookloop/left", 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
    except RuntimeError:  # the store is gone: nothing left to wait for
        return


def wrap_data_parallel(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DDP-wrap ``model`` when there is more than one rank; otherwise return it as is."""
    from torch.nn.parallel import DistributedDataParallel

    if not is_distributed() or dist.get_world_size() == 1:
        return model
    if isinstance(model, DistributedDataParallel):
        return model
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def parallelize(
    model: torch.nn.Module,
    parallel: str,
    device: torch.device,
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.nn.Module:
    """The module the training step runs for ``train.parallel`` (``ddp``, ``fsdp`` or ``local``).

    With ``fsdp`` the model is sharded in place (the returned module is ``model``
    itself) and a given ``optimizer`` is pointed at the sharded parameters.
    With one process every mode returns ``model`` unchanged.
    """
    if parallel == "ddp":
        return wrap_data_parallel(model, device)
    if parallel == "fsdp":
        return shard_fully(model, optimizer)
    if parallel == "local":
        return model
    raise ConfigError(f"train.parallel must be 'ddp', 'fsdp' or 'local', got {parallel!r}")


def shard_fully(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> torch.nn.Module:
    """Shard ``model`` in place with FSDP2 over all ranks; return it.

    Each unit of :func:`shard_units` becomes its own FSDP group (its parameters
    are gathered just before it runs and freed after), then the root takes the
    rest. ``fully_shard`` replaces every parameter with a DTensor, so an
    ``optimizer`` built before this call is re-pointed at the new parameters; it
    must not have stepped yet (its state would belong to the old tensors).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not is_distributed() or dist.get_world_size() == 1 or isinstance(model, FSDPModule):
        return model
    if optimizer is not None and optimizer.state:
        raise ValueError(
            "train.parallel='fsdp' shards the model's parameters, but the optimizer already "
            "holds state for the unsharded ones: pass an optimizer that has not stepped yet "
            "(or none, to build one from the config)"
        )
    # Which parameter each optimizer slot holds, by name: names survive sharding, tensors don't.
    slots = _optimizer_slots(optimizer, model) if optimizer is not None else []
    for unit in shard_units(model):
        fully_shard(unit)
    fully_shard(model)
    if optimizer is not None:
        sharded = dict(model.named_parameters())
        for group, names in zip(optimizer.param_groups, slots, strict=True):
            group["params"] = [sharded[name] for name in names]
    return model


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules FSDP2 shards as separate groups under the root.

    Children that hold parameters, looking through ModuleList/ModuleDict (which
    are never called, so they cannot gather their own parameters). A child that
    shares a parameter with another (tied weights) is left to the root: a
    parameter can belong to one group only.

    >>> mlp = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    >>> [type(m).__name__ for m in shard_units(mlp)]
    ['Linear', 'Linear']
    """
    units: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                visit(child)
            elif next(child.parameters(), None) is not None:
                units.append(child)

    visit(model)
    owners = Counter(id(p) for unit in units for p in unit.parameters())
    return [u for u in units if all(owners[id(p)] == 1 for p in u.parameters())]


def _optimizer_slots(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[list[str]]:
    """The parameter names of each optimizer param group, in order."""
    names = {id(p): name for name, p in model.named_parameters()}
    slots = []
    for group in optimizer.param_groups:
        if any(id(p) not in names for p in group["params"]):
            raise ValueError(
                "train.parallel='fsdp': the optimizer holds a tensor that is not a parameter "
                "of the model; only the model's parameters can be sharded"
            )
        slots.append([names[id(p)] for p in group["params"]])
    return slots


def no_gradient_sync(model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Keep the gradients of the next backward on this rank (a micro-batch before the last).

    DDP's ``no_sync()``; for an FSDP2 model, gradient reduction switched off for
    the block (gradients then accumulate unsharded until the last micro-batch);
    nothing for a model that does not synchronise.
    """
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if is_sharded(model):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` was sharded by FSDP2 (its weights are then saved through DCP)."""
    if not dist.is_available() or "torch.distributed.fsdp" not in sys.modules:
        return False  # FSDP2 was never imported, so nothing is sharded (and it stays unloaded)
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def local_shards(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's slice of each DTensor (other tensors as they are), for per-rank checks."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return list(tensors)
    return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor with the whole value of a DTensor (a collective if it is sharded)."""
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(value, dtensor):
        return value.full_tensor()
    return value


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a list indexed by rank) on every rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_gather_tensor(value: torch.Tensor) -> torch.Tensor:
    """Every rank's ``value`` stacked in rank order (shape ``(world, *value.shape)``)."""
    if not is_distributed():
        return value.unsqueeze(0)
    out = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(out, value.contiguous())
    return torch.stack(out)


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


#: hookloop's own agreement collectives, as a watchdog names them (hookloop.watchdog).
COLLECTIVES = frozenset({
    "agree_flags", "all_reduce_sum", "all_reduce_mean", "gather_objects", "all_gather_tensor",
    "barrier", "broadcast_object", "leave_process_group",
})  # fmt: skip


def collective_in(frame: FrameType | None) -> str | None:
    """The innermost of hookloop's collectives running in ``frame``'s stack, or None.

    Read from the stack by a watchdog thread, so the collectives themselves record nothing.
    """
    while frame is not None:
        code = frame.f_code
        if code.co_name in COLLECTIVES and code.co_filename == __file__:
            return code.co_name
        frame = frame.f_back
    return None
