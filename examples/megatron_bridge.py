"""Megatron-Bridge's callbacks and pretrain() on hookloop, on a CPU-sized GPT.

    python examples/megatron_bridge.py [OUT_DIR]

Code written for NVIDIA's Megatron-Bridge runs once its ``megatron.bridge`` imports read
``hookloop.compat.megatron_bridge``. A class-based callback times the steps, a functional
one prints each validation, and ``pretrain`` trains a 2-layer byte-level GPT (the
standard library's source as text, nothing downloaded) for 6 iterations. The checkpoint
and Megatron-Bridge's ``progress.txt`` go to OUT_DIR (a temporary directory when none
is given).
"""

import sys
import tempfile
import time

from hookloop.compat.megatron_bridge.recipes import tiny_gpt_pretrain_config
from hookloop.compat.megatron_bridge.training.callbacks import Callback, CallbackManager
from hookloop.compat.megatron_bridge.training.gpt_step import forward_step
from hookloop.compat.megatron_bridge.training.pretrain import pretrain


class StepTimer(Callback):
    """Megatron-Bridge's Callback: one method per event, each given a ``context``."""

    def on_train_start(self, context):
        self.started = time.perf_counter()
        print(f"training starts at step {context.state.train_state.step}")

    def on_train_step_end(self, context):
        loss = context.loss_dict["lm loss"].item()
        print(f"step {context.state.train_state.step}: lm loss {loss:.3f}")

    def on_train_end(self, context):
        print(f"trained in {time.perf_counter() - self.started:.2f}s")


def main(out_dir: str) -> None:
    config = tiny_gpt_pretrain_config(train_iters=6, eval_interval=3, save=out_dir)
    config.logger.log_progress = True  # Megatron-Bridge's progress.txt beside the checkpoint

    manager = CallbackManager()
    manager.add(StepTimer())
    manager.register(
        "on_eval_end",
        lambda context: print(f"validation: lm loss {context.total_loss_dict['lm loss']:.3f}"),
    )  # pretrain validates once more after on_train_end, as Megatron-Bridge does
    pretrain(config, forward_step, callbacks=manager)
    print(f"checkpoint and progress.txt in {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="hookloop-mb-"))
