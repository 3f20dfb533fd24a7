"""The Megatron-Bridge dialect: its callbacks and entry points over the hookloop engine.

The module paths mirror Megatron-Bridge's, so code written for it runs once its
``megatron.bridge`` imports point here:

- :mod:`.training.callbacks`: ``Callback``, ``CallbackContext``, ``CallbackManager``;
- :mod:`.training.pretrain` / :mod:`.training.finetune`: the entry points;
- :mod:`.training.train`: Megatron-Bridge's own loop (``train``, ``train_step`` and the
  12 other functions) over a model, optimizer and data iterators you built, with
  :mod:`.training.forward_backward`, :mod:`.training.eval`, :mod:`.training.checkpointing`
  and :mod:`.training.megatron_core` (what only Megatron-Core objects have);
- :mod:`.training.sample_counts`: ``consumed_valid_samples`` of a ``pretrain()`` run;
- :mod:`.training.gpt_step`: ``forward_step`` for the small GPT;
- :mod:`.training.state`: ``GlobalState`` (``cfg``, ``train_state``, ``timers``,
  ``tensorboard_logger``, ``wandb_logger``);
- :mod:`.training.config`: ``ConfigContainer``, the Megatron-Bridge-shaped config sections;
- :mod:`.training.native_events`: how the native loop fires the dialect's events;
- :mod:`.training.progress`: ``logger.log_progress``'s ``progress.txt``;
- :mod:`.recipes`: ``tiny_gpt_pretrain_config`` (a ``ConfigContainer``) and
  ``small_gpt_pretrain_config`` (a native ``Config``), each trains in seconds.

Everything here is an adapter at the edge: each dialect event with callbacks becomes
one native registration and the entry points call :mod:`hookloop.entry`. The engine
knows nothing of it. Where the dialect differs from Megatron-Bridge on purpose:
``docs/megatron-bridge.md``.
"""
