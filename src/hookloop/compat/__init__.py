"""Dialects: the seed callback APIs, served by thin adapters over the native engine.

Each dialect lives in its own subpackage and is driven by the one table in
:mod:`hookloop.compat.mapping`; the engine (``hookloop.trainer``,
``hookloop.manager``) knows nothing about any of them.

- ``hookloop.compat.megatron_bridge``: seed 000/002 (``Callback(context)``, ``pretrain``).
- ``hookloop.compat.hpo``: seed 001 (``TrainingCallback(trainer, **fields)``).
- ``hookloop.compat.hf``: seed 004 and HuggingFace (``(args, state, control, **kwargs)``).
"""
