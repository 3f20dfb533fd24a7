"""Five small training scripts that make the calls transformers' example scripts make.

    python tests/_hf_example_tasks.py {hf|hookloop} {clm|mlm|glue|ner|summarization} ARGS...

Each mirrors one of transformers' ``examples/pytorch`` scripts (``run_clm``, ``run_mlm``,
``run_glue``, ``run_ner``, ``run_summarization``) in what it asks of transformers: its
command line read by ``HfArgumentParser`` into model, data and training arguments, the
logging set-up from ``get_process_log_level``, the last checkpoint looked up, the data
mapped under ``main_process_first``, then train / evaluate / predict with
``log_metrics``, ``save_metrics``, ``save_state`` and ``create_model_card`` last. The
models, the tokenizer and the data are tiny and built here; the metrics a script would
load with ``evaluate.load`` (and the sentence splitting it asks of nltk) are small
local functions. The only line that differs between the two runs is the import of the
Trainer and its arguments.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import HfArgumentParser, PreTrainedTokenizerFast, set_seed
from transformers.trainer_utils import get_last_checkpoint

KIND, TASK = sys.argv[1], sys.argv[2]
if KIND == "hf":
    from transformers import (
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        Trainer,
        TrainingArguments,
    )
else:
    from hookloop.compat.hf import (
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        Trainer,
        TrainingArguments,
    )

warnings.simplefilter("ignore")
torch.set_num_threads(1)
logger = logging.getLogger(__name__)
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = 40


@dataclass
class ModelArguments:
    """The tiny model each task builds."""

    hidden_size: int = field(default=16, metadata={"help": "the model's width"})
    model_name: str = field(default="tiny-local", metadata={"help": "named in the model card"})


@dataclass
class DataTrainingArguments:
    """How much data, and how long the sequences are."""

    max_train_samples: int = field(default=24, metadata={"help": "training examples"})
    max_eval_samples: int = field(default=8, metadata={"help": "evaluation examples"})
    max_seq_length: int = field(default=12, metadata={"help": "tokens per example"})
    val_max_target_length: int = field(default=5, metadata={"help": "generation length"})
    num_beams: int = field(default=2, metadata={"help": "beams when generating"})


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({f"w{i}": len(SPECIALS) + i for i in range(VOCAB - len(SPECIALS))})
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        eos_token="[SEP]",
        model_max_length=32,
    )


def sentences(n: int, seed: int) -> list[list[str]]:
    """Runs of words that count up by a fixed stride (something a model can learn)."""
    rng = np.random.default_rng(seed)
    words = VOCAB - len(SPECIALS)
    out = []
    for _ in range(n):
        length, start, stride = rng.integers(4, 10), rng.integers(0, words), rng.integers(1, 3)
        out.append([f"w{(start + stride * j) % words}" for j in range(length)])
    return out


def accuracy(predictions: Any, references: Any) -> dict[str, float]:
    """What ``evaluate.load("accuracy").compute`` answers."""
    predictions, references = np.asarray(predictions), np.asarray(references)
    return {"accuracy": float((predictions == references).mean())}


def set_up_logging(args: Any) -> None:
    """The logging every example script sets up from the training arguments."""
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    if args.should_log:
        transformers.utils.logging.set_verbosity_info()
    level = args.get_process_log_level()
    logger.setLevel(level)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()
    logger.warning(
        f"rank {args.local_process_index}, device {args.device}, gpus {args.n_gpu}, "
        f"distributed {args.parallel_mode.value == 'distributed'}, fp16 {args.fp16}"
    )
    logger.info(f"arguments {args}")


def last_checkpoint(args: Any) -> str | None:
    if os.path.isdir(args.output_dir) and args.do_train:
        return get_last_checkpoint(args.output_dir)
    return None


# -- the five tasks: (model, datasets, collator, compute_metrics, preprocess) --------------
def causal_lm(model_args: Any, data_args: Any, args: Any, tok: Any) -> dict[str, Any]:
    text = [" ".join(s) for s in sentences(data_args.max_train_samples * 3, 1)]
    raw = datasets.Dataset.from_dict({"text": text})
    block = 8

    def group(batch: dict[str, Any]) -> dict[str, Any]:
        ids = [i for row in batch["input_ids"] for i in row]
        ids = ids[: len(ids) // block * block]
        chunks = [ids[i : i + block] for i in range(0, len(ids), block)]
        return {
            "input_ids": chunks,
            "attention_mask": [[1] * block for _ in chunks],
            "labels": [list(c) for c in chunks],
        }

    with args.main_process_first(desc="tokenising and grouping"):
        tokenized = raw.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])
        grouped = tokenized.map(group, batched=True, remove_columns=tokenized.column_names)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=model_args.hidden_size,
        n_layer=1,
        n_head=2,
        pad_token_id=0,
    )

    def metrics(p: Any) -> dict[str, float]:
        preds, labels = p
        return accuracy(preds[:, :-1].reshape(-1), labels[:, 1:].reshape(-1))

    return {
        "model": transformers.GPT2LMHeadModel(config),
        "data": grouped,
        "collator": transformers.default_data_collator,
        "metrics": metrics,
        "preprocess": lambda logits, labels: logits.argmax(dim=-1),
    }


def _bert(model_args: Any) -> Any:
    return transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=model_args.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )


def masked_lm(model_args: Any, data_args: Any, args: Any, tok: Any) -> dict[str, Any]:
    text = [" ".join(s) for s in sentences(data_args.max_train_samples + 16, 2)]
    with args.main_process_first(desc="tokenising"):
        data = datasets.Dataset.from_dict({"text": text}).map(
            lambda b: tok(b["text"], truncation=True, max_length=data_args.max_seq_length),
            batched=True,
            remove_columns=["text"],
        )

    def metrics(p: Any) -> dict[str, float]:
        preds, labels = p
        keep = labels != -100
        return accuracy(preds[keep], labels[keep])

    collator = transformers.DataCollatorForLanguageModeling(tok, mlm_probability=0.3)
    return {
        "model": transformers.BertForMaskedLM(_bert(model_args)),
        "data": data,
        "collator": collator,
        "metrics": metrics,
        "preprocess": lambda logits, labels: logits.argmax(dim=-1),
    }


def classification(model_args: Any, data_args: Any, args: Any, tok: Any) -> dict[str, Any]:
    rows = sentences(data_args.max_train_samples + 16, 3)
    labels = [int(int(s[0][1:]) % 2) for s in rows]  # the parity of the first word
    with args.main_process_first(desc="tokenising"):
        data = datasets.Dataset.from_dict(
            {"sentence": [" ".join(s) for s in rows], "label": labels}
        )
        data = data.map(
            lambda b: tok(
                b["sentence"],
                padding="max_length",
                truncation=True,
                max_length=data_args.max_seq_length,
            ),
            batched=True,
        )
    config = _bert(model_args)
    config.num_labels = 2
    return {
        "model": transformers.BertForSequenceClassification(config),
        "data": data,
        "collator": transformers.default_data_collator,
        "metrics": lambda p: accuracy(np.argmax(p.predictions, axis=1), p.label_ids),
    }


def token_classification(model_args: Any, data_args: Any, args: Any, tok: Any) -> dict[str, Any]:
    rows = sentences(data_args.max_train_samples + 16, 4)
    tags = [[int(w[1:]) % 3 for w in s] for s in rows]

    def align(batch: dict[str, Any]) -> dict[str, Any]:
        encoded = tok(
            batch["tokens"],
            truncation=True,
            is_split_into_words=True,
            max_length=data_args.max_seq_length,
        )
        encoded["labels"] = [
            [-100 if w is None else batch["ner_tags"][i][w] for w in encoded.word_ids(i)]
            for i in range(len(batch["tokens"]))
        ]
        return encoded

    with args.main_process_first(desc="tokenising and aligning labels"):
        data = datasets.Dataset.from_dict({"tokens": rows, "ner_tags": tags})
        data = data.map(align, batched=True, remove_columns=["tokens", "ner_tags"])
    config = _bert(model_args)
    config.num_labels = 3

    def metrics(p: Any) -> dict[str, float]:
        preds, labels = np.argmax(p[0], axis=2), p[1]
        keep = labels != -100
        return accuracy(preds[keep], labels[keep])

    return {
        "model": transformers.BertForTokenClassification(config),
        "data": data,
        "collator": transformers.DataCollatorForTokenClassification(tok),
        "metrics": metrics,
    }


def summarization(model_args: Any, data_args: Any, args: Any, tok: Any) -> dict[str, Any]:
    rows = sentences(data_args.max_train_samples + 16, 5)
    with args.main_process_first(desc="tokenising sources and targets"):
        data = datasets.Dataset.from_dict(
            {"document": [" ".join(s) for s in rows], "summary": [" ".join(s[:3]) for s in rows]}
        )
        data = data.map(
            lambda b: {**tok(b["document"]), "labels": tok(text_target=b["summary"])["input_ids"]},
            batched=True,
            remove_columns=["document", "summary"],
        )
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=model_args.hidden_size,
        d_ff=32,
        d_kv=8,
        num_layers=1,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=3,
    )
    model = transformers.T5ForConditionalGeneration(config)

    def metrics(p: Any) -> dict[str, float]:
        """Unigram overlap of the decoded texts (what rouge1 measures), and the length."""
        preds, labels = p
        preds = np.where(preds != -100, preds, tok.pad_token_id)
        labels = np.where(labels != -100, labels, tok.pad_token_id)
        decoded = tok.batch_decode(preds.tolist(), skip_special_tokens=True)
        wanted = tok.batch_decode(labels.tolist(), skip_special_tokens=True)
        overlap = [
            len(set(a.split()) & set(b.split())) / max(len(set(b.split())), 1)
            for a, b in zip(decoded, wanted, strict=True)
        ]
        return {
            "rouge1": round(100 * float(np.mean(overlap)), 4),
            "gen_len": float(np.mean([np.count_nonzero(x != tok.pad_token_id) for x in preds])),
        }

    collator = transformers.DataCollatorForSeq2Seq(tok, model=model, label_pad_token_id=-100)
    return {"model": model, "data": data, "collator": collator, "metrics": metrics}


TASKS = {
    "clm": causal_lm,
    "mlm": masked_lm,
    "glue": classification,
    "ner": token_classification,
    "summarization": summarization,
}


def main(argv: list[str]) -> None:
    seq2seq = TASK == "summarization"
    arguments = Seq2SeqTrainingArguments if seq2seq else TrainingArguments
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, arguments))
    model_args, data_args, args = parser.parse_args_into_dataclasses(argv)
    if seq2seq:  # evaluations during training generate as the script's own evaluate does
        args.generation_max_length = args.generation_max_length or data_args.val_max_target_length
        args.generation_num_beams = data_args.num_beams or args.generation_num_beams
    set_up_logging(args)
    checkpoint = last_checkpoint(args)
    set_seed(args.seed)
    tok = build_tokenizer()
    task = TASKS[TASK](model_args, data_args, args, tok)
    n_train, n_eval = data_args.max_train_samples, data_args.max_eval_samples
    train = task["data"].select(range(n_train))
    held_out = task["data"].select(range(n_train, n_train + 2 * n_eval))
    evaluation, prediction = (
        held_out.select(range(n_eval)),
        held_out.select(range(n_eval, 2 * n_eval)),
    )
    trainer = (Seq2SeqTrainer if seq2seq else Trainer)(
        model=task["model"],
        args=args,
        train_dataset=train if args.do_train else None,
        eval_dataset=evaluation if args.do_eval else None,
        processing_class=tok,
        data_collator=task["collator"],
        compute_metrics=task["metrics"],
        preprocess_logits_for_metrics=task.get("preprocess"),
    )
    generation = {"max_length": data_args.val_max_target_length, "num_beams": data_args.num_beams}
    if args.do_train:
        result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint or checkpoint)
        trainer.save_model()
        metrics = {**result.metrics, "train_samples": len(train)}
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
    if args.do_eval:
        metrics = trainer.evaluate(**generation) if seq2seq else trainer.evaluate()
        metrics["eval_samples"] = len(evaluation)
        if TASK == "clm":
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if args.do_predict:
        predict_more = generation if seq2seq else {}
        if TASK == "glue":
            prediction = prediction.remove_columns("label")
        output = trainer.predict(prediction, metric_key_prefix="predict", **predict_more)
        predictions, _, metrics = output
        trainer.log_metrics("predict", metrics)
        trainer.save_metrics("predict", metrics)
        if trainer.is_world_process_zero():
            rows = predictions if seq2seq else np.argmax(predictions, axis=-1)
            if seq2seq:
                rows = tok.batch_decode(
                    np.where(rows != -100, rows, 0).tolist(), skip_special_tokens=True
                )
            with open(os.path.join(args.output_dir, "predictions.txt"), "w") as f:
                f.writelines(f"{np.asarray(row).tolist()}\n" for row in rows)
    trainer.create_model_card(finetuned_from=model_args.model_name, tasks=TASK)


if __name__ == "__main__":
    main(sys.argv[3:])
