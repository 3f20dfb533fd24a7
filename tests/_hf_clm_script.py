"""An ordinary causal-LM fine-tuning script written for transformers' Trainer.

    python tests/_hf_clm_script.py {hf|hookloop} OUTPUT_DIR {crash|resume}

The only line that differs between the two runs is the Trainer's import. ``crash``
trains towards 8 steps, saving every 2, and dies (``os._exit(3)``, no clean-up) at the
end of step 5; ``resume`` runs the same script with ``resume_from_checkpoint=True`` to
the end, then does what example scripts do after training and writes
``OUTPUT_DIR/result.json`` (the log history and the metrics).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import numpy as np
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    DataCollatorForLanguageModeling,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    TrainerCallback,
    TrainingArguments,
)

kind, output_dir, mode = sys.argv[1], sys.argv[2], sys.argv[3]
if kind == "hf":
    from transformers import Trainer
else:
    from hookloop.compat.hf import Trainer

warnings.simplefilter("ignore")
torch.set_num_threads(1)
VOCAB = 40
vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
backend.pre_tokenizer = WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")

rng = np.random.default_rng(1)
rows = []
for _ in range(12):
    length, start, step = rng.integers(4, 13), rng.integers(2, VOCAB), rng.integers(1, 4)
    rows.append(
        {"input_ids": [int(2 + (start - 2 + step * j) % (VOCAB - 2)) for j in range(length)]}
    )

torch.manual_seed(0)
model = GPT2LMHeadModel(
    GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, pad_token_id=0)
)


class CrashAtStep5(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 5:
            os._exit(3)


args = TrainingArguments(
    output_dir=output_dir,
    max_steps=8,
    save_steps=2,
    logging_steps=1,
    per_device_train_batch_size=2,
    use_cpu=True,
    report_to="none",
    disable_tqdm=True,
)
trainer = Trainer(
    model=model,
    args=args,
    train_dataset=rows,
    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    processing_class=tokenizer,
    callbacks=[CrashAtStep5()] if mode == "crash" else [],
)
result = trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
metrics = result.metrics
trainer.log_metrics("train", metrics)
trainer.save_metrics("train", metrics)
trainer.save_model()
trainer.save_state()
with open(os.path.join(output_dir, "result.json"), "w") as f:
    json.dump({"log_history": trainer.state.log_history, "metrics": metrics}, f)
