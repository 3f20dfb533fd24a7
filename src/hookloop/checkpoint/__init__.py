"""Checkpoints: what is saved, where it is written, when, and the loop's one handle on them.

- :mod:`~hookloop.checkpoint.storage`: *where*. Atomic, verified directories (staging,
  fsync, a manifest of sizes and SHA-256 written last, rename, ``latest``).
- :mod:`~hookloop.checkpoint.state`: *what*. Named state (``{name: object with
  state_dict/load_state_dict}``) serialised into files and restored; RNG, plain dicts,
  stateful callbacks, FSDP2 shards through ``torch.distributed.checkpoint``.
- :mod:`~hookloop.checkpoint.manager`: *when* and which to keep (:class:`SavePolicy`),
  and one run's checkpoints (:class:`CheckpointManager`: capture, commit, retention,
  what a resume restores).
- :mod:`~hookloop.checkpoint.weights`: a model's weights alone (finetuning).
- :mod:`~hookloop.checkpoint.background`: saves committed by a writer thread
  (``checkpoint.async_save``).
- :mod:`~hookloop.checkpoint.local`: frequent local checkpoints beside the persistent
  ones, and what ``resume="auto"`` picks among both.
- :mod:`~hookloop.checkpoint.rewind`: rolling back a divergence to an earlier checkpoint.

Layout under ``<run>/checkpoints/``::

    step-00000070/  model.safetensors  optimizer.pt  trainer_state.pt
                    config.yaml        manifest.json
    latest          (text: the name of the newest complete checkpoint)

A model sharded by FSDP2 (``train.parallel=fsdp``) has no single copy of its weights,
so model and optimizer go through ``torch.distributed.checkpoint``: every rank writes
its own shards into ``sharded/`` of the same staging directory, and the manifest lists
those files like any other::

    step-00000070/  sharded/.metadata  sharded/__0_0.distcp  sharded/__1_0.distcp
                    trainer_state.pt   config.yaml           manifest.json

State sharded like the model (``EMA``'s averages) goes into the same DCP save, under its
own keys (``callbacks.EMA.<parameter>``): see :class:`~.state.ShardedStateful`.
"""

from hookloop.checkpoint.manager import CheckpointManager, SaveJob, SavePolicy
from hookloop.checkpoint.state import (
    CallbackStates,
    DictState,
    RNGState,
    ShardedStateful,
    load_sharded,
    load_state,
    save_sharded,
    save_state,
)
from hookloop.checkpoint.storage import (
    FAULT_ENV,
    FAULT_POINTS,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    MODEL,
    OPTIMIZER,
    SHARDED_DIR,
    STATE_FILE,
    CheckpointError,
    CheckpointStorage,
    check_manifest,
    resolve_checkpoint,
)
from hookloop.checkpoint.weights import load_weights

__all__ = [
    "FAULT_ENV",
    "FAULT_POINTS",
    "FORMAT_VERSION",
    "LATEST",
    "MANIFEST",
    "MODEL",
    "OPTIMIZER",
    "SHARDED_DIR",
    "STATE_FILE",
    "CallbackStates",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointStorage",
    "DictState",
    "RNGState",
    "SaveJob",
    "SavePolicy",
    "ShardedStateful",
    "check_manifest",
    "load_sharded",
    "load_state",
    "load_weights",
    "resolve_checkpoint",
    "save_sharded",
    "save_state",
]
