"""Config functions in Megatron-Bridge's style: call one, get a ready config for ``pretrain``."""

from hookloop.compat.megatron_bridge.recipes.gpt import (
    small_gpt_pretrain_config,
    tiny_gpt_pretrain_config,
)

__all__ = ["small_gpt_pretrain_config", "tiny_gpt_pretrain_config"]
