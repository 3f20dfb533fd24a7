"""Dialects: the seed callback APIs, served by thin adapters over the native engine.

Each dialect lives in its own subpackage, is driven by the one table in
:mod:`hookloop.compat.mapping` and built from one toolkit,
:mod:`hookloop.compat._toolkit` (the adapter mechanism, name and hook checks);
the engine (``hookloop.loop``, ``hookloop.manager``) knows nothing about any
of them. The seeds' names for native callbacks live here, with their dialect,
not in :mod:`hookloop.callbacks`.

- ``hookloop.compat.megatron_bridge``: seed 000/002 (``Callback(context)``, ``pretrain``).
- ``hookloop.compat.hpo``: seed 001 (``TrainingCallback(trainer, **fields)``).
- ``hookloop.compat.hf``: seed 004 and HuggingFace (``(args, state, control, **kwargs)``).
"""
