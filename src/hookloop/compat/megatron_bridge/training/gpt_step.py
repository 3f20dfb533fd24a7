"""``forward_step`` for the small GPT of :mod:`hookloop.compat.megatron_bridge.recipes`.

Megatron-Bridge's signature over the native recipe's step: the loss function returns
``(loss_sum, num_tokens, {"lm loss": mean})``, the token-aware pattern, so the
loop averages over every token of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from hookloop.recipes import gpt


def forward_step(
    global_state: Any,
    data_iterator: Iterator[Any],
    model: torch.nn.Module,
    return_schedule_plan: bool = False,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """Run the next micro-batch through ``model``; return ``(logits, loss_func)``.

    ``return_schedule_plan`` asks for a mixture-of-experts overlap plan, which
    hookloop's models do not have: only ``False`` is accepted.
    """
    if return_schedule_plan:
        raise NotImplementedError(
            "return_schedule_plan=True asks for an MoE overlap schedule plan; hookloop's "
            "GPT has no experts, so call forward_step with return_schedule_plan=False"
        )
    return gpt.forward_step(global_state, data_iterator, model)
