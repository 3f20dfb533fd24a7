"""Dialects: the compatible systems' callback APIs, served by thin adapters over the native engine.

Each dialect lives in its own subpackage, is driven by the one table in
:mod:`hookloop.compat.mapping` and built from one toolkit,
:mod:`hookloop.compat._toolkit` (the adapter mechanism, name and hook checks);
the engine (``hookloop.loop``, ``hookloop.manager``) knows nothing about any
of them. Those systems' names for native callbacks live here, with their dialect,
not in :mod:`hookloop.callbacks`.

- ``hookloop.compat.megatron_bridge``: Megatron-Bridge (``Callback(context)``, ``pretrain``).
- ``hookloop.compat.hpo``: the HPO trainer (``TrainingCallback(trainer, **fields)``).
- ``hookloop.compat.hf``: transformers' Trainer and Forgather
  (``(args, state, control, **kwargs)``).
- ``hookloop.compat.forgather``: Forgather's built-ins, trainer control and DiLoCo parts.
"""
