"""Sample text from fixed prompts at each evaluation, to watch the model learn.

After every evaluation (``on_eval_end``) rank 0 continues each prompt and
keeps the results in ``ctx.user_state["samples"]`` (a list of ``{"step",
"prompt", "text"}``), appends them to the run's samples file
(``ctx.run.dir.samples``: ``<run>/samples.txt``) when the run has a directory
(or to ``path``), and prints them if asked.

Sampling never touches the global RNGs, on which exact resume depends: the
default generator draws from its own ``torch.Generator``, re-seeded with
``seed`` at every evaluation (so samples depend on the weights alone, and a
resumed run writes the same samples), and any ``generate_fn`` runs inside
``torch.random.fork_rng``, which restores the global state afterwards.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
import yaml

from hookloop.callback import Callback
from hookloop.distributed import is_sharded
from hookloop.rundir import SAMPLES_FILE
from hookloop.state import CallbackContext

GenerateFn = Callable[..., str]


class TextgenCallback(Callback):
    """Generates continuations of ``prompts`` at each evaluation (see the module doc).

    ``prompts`` is a list of strings, or the path of a YAML file holding one.
    ``generate_fn(model, prompt) -> str`` returns the continuation; it may also
    take a ``generator`` keyword, which then receives the callback's seeded
    ``torch.Generator``. The default is the gpt-stdlib recipe's sampler
    (:func:`hookloop.recipes.gpt.generate`) with ``max_new_tokens``,
    ``temperature`` and ``top_k``. The model is put in eval mode for sampling
    and returned to its previous mode afterwards.
    """

    priority = 60

    def __init__(
        self,
        prompts: Sequence[str] | str | Path,
        *,
        generate_fn: GenerateFn | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.8,
        top_k: int | None = 40,
        seed: int = 0,
        path: str | Path | None = None,
        print_samples: bool = True,
        stream: TextIO | str | None = "stderr",
    ) -> None:
        self.prompts = load_prompts(prompts)
        if generate_fn is not None and not callable(generate_fn):
            raise ValueError(
                f"generate_fn must be callable(model, prompt) -> str, got {generate_fn!r}"
            )
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or temperature < 0
        ):
            raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
        if top_k is not None and (
            isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1
        ):
            raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if path is not None and (not isinstance(path, (str, Path)) or not str(path)):
            raise ValueError(
                f"path must be a file path or None (use <run>/{SAMPLES_FILE}), got {path!r}"
            )
        if not isinstance(print_samples, bool):
            raise ValueError(f"print_samples must be True or False, got {print_samples!r}")
        if isinstance(stream, str) and stream not in ("stdout", "stderr"):
            raise ValueError(f"stream must be a text stream, 'stdout' or 'stderr', got {stream!r}")
        self.generate_fn = generate_fn
        self.max_new_tokens = max_new_tokens
        self.temperature = float(temperature)
        self.top_k = top_k
        self.seed = seed
        self.path = Path(path) if path is not None else None
        self.print_samples = print_samples
        self.stream = stream
        self._takes_generator = generate_fn is not None and _accepts(generate_fn, "generator")
        self.samples: list[dict[str, Any]] = []  # the latest evaluation's samples
        self._written: Path | None = None  # the samples file, once known

    def on_train_start(self, ctx: CallbackContext) -> None:
        self._written = self._file(ctx)  # known from the start, so a checkpoint records it

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if ctx.model is None:
            return
        if not ctx.state.is_rank_zero:
            # A sharded model gathers its weights in every forward: all ranks must generate
            # together (same seeded generator, same tokens); only rank 0 keeps the text.
            if is_sharded(ctx.model):
                self.generate(ctx.model)
            return
        self.samples = [
            {"step": ctx.state.step, "prompt": p, "text": t}
            for p, t in zip(self.prompts, self.generate(_unwrap(ctx.model)), strict=True)
        ]
        ctx.user_state["samples"] = [dict(s) for s in self.samples]
        text = self.format(self.samples, ctx.state.step)
        target = self._file(ctx)
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("a", encoding="utf-8") as f:
                f.write(text)
            self._written = target
        if self.print_samples:
            out = {"stdout": sys.stdout, "stderr": sys.stderr}.get(self.stream, self.stream)  # type: ignore[arg-type]  # else a stream
            print(text, end="", file=out, flush=True)

    def generate(self, model: torch.nn.Module) -> list[str]:
        """One continuation per prompt, without disturbing the global RNG state."""
        was_training = model.training
        generator = torch.Generator().manual_seed(self.seed)
        devices = _cuda_devices(model)
        model.eval()
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                # Inside the fork only, and only the RNGs it restores: a generate_fn that
                # draws from the global RNG still samples reproducibly.
                torch.default_generator.manual_seed(self.seed)
                for index in devices:
                    torch.cuda.default_generators[index].manual_seed(self.seed)
                return [self._one(model, prompt, generator) for prompt in self.prompts]
        finally:
            model.train(was_training)

    def _one(self, model: torch.nn.Module, prompt: str, generator: torch.Generator) -> str:
        if self.generate_fn is None:
            from hookloop.recipes.gpt import generate

            return generate(
                model,  # type: ignore[arg-type]  # the GPT recipe's model, which generate() needs
                prompt,
                self.max_new_tokens,
                temperature=self.temperature,
                top_k=self.top_k,
                generator=generator,
            )
        if self._takes_generator:
            return str(self.generate_fn(model, prompt, generator=generator))
        return str(self.generate_fn(model, prompt))

    def state_dict(self) -> dict[str, Any]:
        """How far the samples file had been written (a resume cuts off the rest)."""
        if self._written is None:
            return {"file": None, "offset": 0}
        size = self._written.stat().st_size if self._written.exists() else 0
        return {"file": str(self._written), "offset": size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Drop samples written after the checkpoint: the resumed run writes them again."""
        if not state.get("file"):
            return
        self._written = Path(state["file"])
        offset = int(state.get("offset", 0))
        if self._written.exists() and self._written.stat().st_size > offset:
            with self._written.open("r+b") as f:
                f.truncate(offset)

    @staticmethod
    def format(samples: list[dict[str, Any]], step: int) -> str:
        """The text block appended to the samples file for one evaluation."""
        lines = [f"=== step {step} ==="]
        for s in samples:
            lines.append(f"--- prompt: {s['prompt']!r}")
            lines.append(s["prompt"] + s["text"])
        return "\n".join(lines) + "\n\n"

    def _file(self, ctx: CallbackContext) -> Path | None:
        if self.path is not None:
            return self.path
        return ctx.run.dir.samples if ctx.run.dir is not None else None

    def __repr__(self) -> str:
        return f"TextgenCallback(priority={self.priority}, prompts={len(self.prompts)})"


def load_prompts(prompts: Sequence[str] | str | Path) -> list[str]:
    """Prompts as given (a list of strings), or the list a YAML file holds."""
    if isinstance(prompts, (str, Path)):
        file = Path(prompts)
        if not file.is_file():
            raise ValueError(
                f"prompts must be a list of strings or the path of a YAML file holding one; "
                f"{str(prompts)!r} is not a file (for a single prompt, pass [{str(prompts)!r}])"
            )
        try:
            loaded = yaml.safe_load(file.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise ValueError(f"prompts file {file} is not valid YAML: {err}") from None
        if not isinstance(loaded, list):
            raise ValueError(
                f"prompts file {file} must hold a list of strings, got {type(loaded).__name__}"
            )
        prompts = loaded
    prompts = list(prompts)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r}")
    return prompts


def _accepts(fn: Callable[..., Any], keyword: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in params)


def _cuda_devices(model: torch.nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model
