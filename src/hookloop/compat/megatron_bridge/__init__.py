"""The seed 000/002 dialect: Megatron-Bridge's callback API over the hookloop engine.

The module paths mirror the seed's, so code written for it runs once its
``megatron.bridge`` imports point here:

- :mod:`.training.callbacks`: ``Callback``, ``CallbackContext``, ``CallbackManager``;
- :mod:`.training.pretrain` / :mod:`.training.finetune`: the entry points;
- :mod:`.training.gpt_step`: ``forward_step`` for the small GPT;
- :mod:`.training.state`: ``GlobalState`` (``cfg``, ``train_state``, ``timers``,
  ``tensorboard_logger``, ``wandb_logger``);
- :mod:`.training.config`: ``ConfigContainer``, the seed-shaped config sections;
- :mod:`.recipes`: ``tiny_gpt_pretrain_config`` (a ``ConfigContainer``) and
  ``small_gpt_pretrain_config`` (a native ``Config``), each trains in seconds.

Everything here is an adapter at the edge: dialect callbacks become native
registrations (dispatch read from :mod:`hookloop.compat.mapping`) and the
entry points call :mod:`hookloop.entry`. The engine knows nothing of it.
"""
