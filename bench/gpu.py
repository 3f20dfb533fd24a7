"""hookloop on a CUDA GPU: host-device syncs, checkpoint saves, MFU, loop overhead, memory.

Every section uses the default recipe's model (``gpt-stdlib``: byte-level GPT, 4 layers,
width 128, context 128, batch 32, AdamW) unless it says otherwise; ``--big`` sections
also run a GPU-bound variant (12 layers, width 768, context 256).

- ``sync``: host-device syncs per step, found two ways: ``torch.cuda.set_sync_debug_mode``
  ("warn"; each warning is attributed to its step, inside the step or at its boundary,
  and to the innermost hookloop/recipe frame), and a GPU sleep queued at the start of
  each step (a step whose host time covers the sleep waited for the GPU, whether or not
  torch flags the call: a copy from pageable memory is not flagged).
- ``ckpt``: ``bench/checkpoint.py``'s method and table, its runs moved to CUDA.
- ``mfu``: what ``DefaultMetrics`` logs (``mfu``, ``tok_per_sec``; peak 989e12 FLOP/s,
  H100 SXM dense bf16) against the same FLOPs over synchronised wall time.
- ``loop``: ``bench/loop.py``'s method on CUDA: a raw PyTorch loop against
  ``Trainer.train()`` on the same model and the same pre-made CUDA batches, each
  contender between two raw runs, its ratio against their mean; medians over rounds.
- ``mem``: ``torch.cuda.max_memory_allocated()`` while training, fp32 / bf16 / fp16.
- ``launch``: kernels per raw step, the host cost of a launch, host time per phase.

    python bench/gpu.py                        # every section
    python bench/gpu.py --only sync,loop       # some
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import random
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F

import hookloop
from _timing import format_table, median, quartiles, shuffled
from hookloop import Callback, Trainer
from hookloop.callbacks.defaults import default_callbacks
from hookloop.callbacks.metrics import DefaultMetrics
from hookloop.config import Config
from hookloop.entry import build_trainer, seed_everything
from hookloop.optim import build_optimizer
from hookloop.recipes import default_config
from hookloop.recipes.gpt import GPT, load_corpus, split_corpus

PEAK_FLOPS = 989e12  # H100 SXM, dense bf16 (the figure DefaultMetrics' docstring names)
SECTIONS = ("sync", "ckpt", "mfu", "loop", "mem", "launch")
BIG = {"n_layer": 12, "n_embd": 768, "n_head": 12, "block_size": 256}
HOOKLOOP = str(Path(hookloop.__file__).resolve().parent)  # where syncs are attributed


def recipe_config(precision: str = "bf16", steps: int = 40, **model: Any) -> Config:
    cfg = default_config("gpt-stdlib")
    cfg.train.device = "cuda"
    cfg.train.precision = precision
    cfg.train.max_steps = steps
    cfg.train.eval_every = None
    cfg.train.eval_at_epoch_end = False
    cfg.train.handle_signals = False
    cfg.checkpoint.every = None
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return cfg


def cuda_batches(cfg: Config, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of the recipe's training windows, already on the GPU."""
    corpus = load_corpus(cfg.data.source, cfg.data.max_bytes)
    train, _ = split_corpus(corpus, cfg.model.block_size, cfg.data.eval_fraction)
    bs = cfg.data.batch_size
    out = []
    for i in range(n):
        items = [train[(i * bs + j) % len(train)] for j in range(bs)]
        x = torch.stack([a for a, _ in items]).cuda()
        y = torch.stack([b for _, b in items]).cuda()
        out.append((x, y))
    return out


def mean_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def list_trainer(cfg: Config, batches: list, callbacks: list | None = None) -> Trainer:
    """The recipe's model and optimizer on pre-made CUDA batches, with a mean-CE loss_fn."""
    seed_everything(cfg.seed)
    model = GPT(cfg.model)
    return Trainer(
        model,
        build_optimizer(cfg.optimizer, model),
        train_data=batches,
        loss_fn=mean_ce,
        config=cfg,
        callbacks=callbacks or [],
    )


# -- sync -----------------------------------------------------------------------------------------


class Phase(Callback):
    """Whether the loop is inside a training step (start..end events) or at its boundary."""

    def __init__(self) -> None:
        self.inside = False

    def on_train_step_start(self, ctx) -> None:
        self.inside = True

    def on_train_step_end(self, ctx) -> None:
        self.inside = False


def _where(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame in hookloop (or the recipe), else the innermost frame."""
    for frame in reversed(stack):
        if frame.filename.startswith(HOOKLOOP):
            rel = frame.filename[len(HOOKLOOP) + 1 :]
            return f"{rel}:{frame.lineno} {frame.name} | {(frame.line or '').strip()[:60]}"
    frame = stack[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"


@contextlib.contextmanager
def flagged_syncs(trainer: Trainer, phase: Phase):
    """Record (step, inside step?, where) for each sync torch's debug mode flags."""
    records: list[tuple[int, bool, str]] = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" in str(message):
            stack = traceback.extract_stack()[:-1]
            records.append((trainer.state.step, phase.inside, _where(stack)))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield records
        finally:
            torch.cuda.set_sync_debug_mode("default")


def sleep_cycles(ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the GPU busy for about ``ms``."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * ms / start.elapsed_time(end))


class SleepProbe(Callback):
    """Queues a GPU sleep as the first step after each log starts (the log's read-back
    emptied the GPU's queue, so the step's own ~340 launches cannot fill it and block
    the host); records that step's host time."""

    def __init__(self, cycles: int, every: int) -> None:
        self.cycles, self.every = cycles, every
        self.host_s: dict[int, float] = {}
        self._t: float | None = None

    def on_train_step_start(self, ctx) -> None:
        if ctx.state.step % self.every == 1:
            torch.cuda._sleep(self.cycles)
            self._t = time.perf_counter()

    def on_train_step_end(self, ctx) -> None:
        if self._t is not None:
            self.host_s[ctx.state.step] = time.perf_counter() - self._t
            self._t = None


def sync_case(name: str, build, log_every: int, steps: int, sleep_ms: float) -> list[str]:
    lines = [f"[{name}] log_every={log_every}, {steps} steps"]
    phase = Phase()
    trainer = build([phase])
    with flagged_syncs(trainer, phase) as records:
        trainer.train()
    torch.cuda.synchronize()
    log_steps = {s for s in range(1, steps + 1) if log_every and s % log_every == 0}
    non_log = [s for s in range(2, steps + 1) if s not in log_steps]  # step 1: first-time setup
    inside = Counter(w for s, i, w in records if i and s in non_log)
    inside_log = Counter(w for s, i, w in records if i and s in log_steps)
    boundary = Counter(w for s, i, w in records if not i and s in log_steps)
    other = Counter(w for s, i, w in records if not i and s in non_log)
    per = len(non_log)
    lines.append(f"  flagged inside a non-log step: {sum(inside.values()) / per:.2f} per step")
    lines += [f"    {n / per:.2f}/step  {w}" for w, n in inside.most_common()]
    if log_steps:
        nl = len(log_steps)
        lines.append(f"  flagged inside a log step: {sum(inside_log.values()) / nl:.2f} per step")
        lines.append(f"  flagged at a log boundary: {sum(boundary.values()) / nl:.2f} per log")
        lines += [f"    {n / nl:.2f}/log   {w}" for w, n in boundary.most_common()]
    if other:
        lines.append(f"  flagged at a non-log boundary: {dict(other)}")
    first = Counter(w for s, i, w in records if s <= 1)
    if first:
        lines.append(f"  flagged before and in step 1 (set-up): {dict(first)}")
    # Hidden waits: a sleep queued at each step's start.
    cycles = sleep_cycles(sleep_ms)
    probe = SleepProbe(cycles, log_every)
    trainer = build([probe])
    trainer.train()
    torch.cuda.synchronize()
    probed = [s for s in sorted(probe.host_s) if s > 1]
    waited = [s for s in probed if probe.host_s[s] > 0.5 * sleep_ms / 1e3]
    host = [probe.host_s[s] * 1e3 for s in probed]
    lines.append(
        f"  GPU sleep {sleep_ms:.0f} ms queued as steps {probed} start: {len(waited)}/"
        f"{len(probed)} waited for it (host ms: {', '.join(f'{h:.1f}' for h in host)})"
    )
    return lines


def section_sync(args) -> None:
    steps, every = 16, 4

    def listed(precision, skip, clip=1.0):
        def build(cbs):
            cfg = recipe_config(precision, steps)
            cfg.train.log_every = every
            cfg.train.skip_nonfinite = skip
            cfg.train.clip_grad_norm = clip
            return list_trainer(cfg, cuda_batches(cfg, steps), cbs)

        return build

    def recipe(precision, skip, defaults=False):
        def build(cbs):
            cfg = recipe_config(precision, steps)
            cfg.train.log_every = every
            cfg.train.skip_nonfinite = skip
            if defaults:  # as `hookloop train` adds them (no control server)
                cfg.logging.progress = False
                cbs = [*default_callbacks(cfg, tempfile.mkdtemp()), *cbs]
            return build_trainer(cfg, callbacks=cbs)

        return build

    cases = [
        ("CUDA batches + loss_fn, bf16, skip_nonfinite=False", listed("bf16", False)),
        ("CUDA batches + loss_fn, bf16, skip_nonfinite=True", listed("bf16", True)),
        ("CUDA batches + loss_fn, fp16 (GradScaler), skip_nonfinite=False", listed("fp16", False)),
        ("CUDA batches + loss_fn, fp32, no clip, skip_nonfinite=0", listed("fp32", False, None)),
        ("gpt-stdlib recipe (its DataLoader and forward_step), bf16, skip_nonfinite=False",
         recipe("bf16", False)),
        ("gpt-stdlib recipe, bf16, skip_nonfinite=True (default)", recipe("bf16", True)),
        ("gpt-stdlib recipe + hookloop train's default callbacks, bf16, skip_nonfinite=True",
         recipe("bf16", True, defaults=True)),
    ]  # fmt: skip
    for name, build in cases:
        if args.recipe_only and not name.startswith("gpt-stdlib"):
            continue
        print("\n".join(sync_case(name, build, every, steps, args.sleep_ms)), flush=True)


# -- checkpoint -------------------------------------------------------------------------------


def section_ckpt(args) -> None:
    import checkpoint as bench_ckpt

    original = bench_ckpt.build_trainer

    rounds = ["--rounds", str(args.ckpt_rounds)]
    mid = {"n_layer": 8, "n_embd": 512, "n_head": 8}
    for label, model, pause, argv in (
        ("default model, every=2 (the bench as is)", {}, 0.0, [*rounds, "--steps", "10"]),
        ("default model, every=4, 0.3 s pause after each save", {}, 0.3,
         [*rounds, "--steps", "13"]),
        ("n_layer=8, n_embd=512 (25M params), every=4, 2 s pause after each save", mid, 2.0,
         ["--rounds", "2", "--steps", "13"]),
    ):  # fmt: skip

        def on_cuda(cfg, _model=model, _pause=pause, **kw):
            cfg.train.device = "cuda"
            for key, value in _model.items():
                setattr(cfg.model, key, value)
            if _pause:  # saves far enough apart that none waits for the one before
                cfg.checkpoint.every = 4
            trainer = original(cfg, **kw)
            if _pause:
                trainer.callbacks.register(
                    "on_train_step_end",
                    lambda ctx: time.sleep(_pause) if ctx.state.step % 4 == 1 else None,
                )
            return trainer

        bench_ckpt.build_trainer = on_cuda
        print(f"\n[checkpoint, CUDA, {label}] bench/checkpoint.py {' '.join(argv)}", flush=True)
        bench_ckpt.main(argv)
    bench_ckpt.build_trainer = original


# -- MFU ----------------------------------------------------------------------------------------


class Logs(Callback):
    priority = 50  # after DefaultMetrics (20) has added its keys

    def __init__(self) -> None:
        self.logs: list[tuple[int, dict]] = []

    def on_log(self, ctx) -> None:
        self.logs.append((ctx.state.step, dict(ctx.logs)))


class SyncedClock(Callback):
    """Synchronised wall time at the end of steps ``a`` and ``b`` (two syncs a run)."""

    def __init__(self, a: int, b: int) -> None:
        self.a, self.b, self.t = a, b, {}

    def on_train_step_end(self, ctx) -> None:
        if ctx.state.step in (self.a, self.b):
            torch.cuda.synchronize()
            self.t[ctx.state.step] = time.perf_counter()


def mfu_case(label: str, steps: int, skip: bool, **model: Any) -> list[Any]:
    cfg = recipe_config("bf16", steps, **model)
    cfg.train.skip_nonfinite = skip
    a = steps // 4
    a -= a % cfg.train.log_every
    logs, clock = Logs(), SyncedClock(a, steps)
    trainer = build_trainer(cfg, callbacks=[DefaultMetrics(PEAK_FLOPS), logs, clock])
    trainer.train()
    flops = trainer.flops_per_sample * cfg.data.batch_size * (steps - a)
    seconds = clock.t[steps] - clock.t[a]
    ref_mfu = flops / seconds / PEAK_FLOPS
    ref_tok = cfg.data.batch_size * cfg.model.block_size * (steps - a) / seconds
    window = [lg for s, lg in logs.logs if a < s <= steps]
    mfu = median([lg["mfu"] for lg in window])
    tok = median([lg["tok_per_sec"] for lg in window])
    params = trainer.model.num_params()
    return [
        label,
        f"{params / 1e6:.2f}M",
        "on" if skip else "off",
        f"{mfu * 100:.3f}",
        f"{ref_mfu * 100:.3f}",
        f"{mfu / ref_mfu:.2f}",
        f"{tok:,.0f}",
        f"{ref_tok:,.0f}",
        f"{seconds / (steps - a) * 1e3:.2f}",
    ]


def section_mfu(args) -> None:
    rows = []
    for skip in (True, False):
        rows.append(mfu_case("gpt-stdlib default", 300, skip))
    if args.big:
        for skip in (True, False):
            rows.append(mfu_case("12x768, ctx 256", 80, skip, **BIG))
    print(
        f"\n[MFU] bf16, peak {PEAK_FLOPS:.3g} FLOP/s; logged = DefaultMetrics' median over the "
        "logs in the timed window; synced = the recipe's FLOPs over wall time between two "
        "torch.cuda.synchronize() calls (steps N/4..N)"
    )
    print(
        format_table(
            ["model", "params", "skip_nonfinite", "mfu % logged", "mfu % synced",
             "logged/synced", "tok/s logged", "tok/s synced", "ms/step synced"],
            rows,
        )
    )  # fmt: skip


# -- loop: raw PyTorch vs Trainer ----------------------------------------------------------------


def raw_loop(cfg: Config, batches: list) -> tuple[Any, Any]:
    seed_everything(cfg.seed)
    model = GPT(cfg.model).cuda()
    opt = build_optimizer(cfg.optimizer, model)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)

    def run() -> None:
        for x, y in batches:
            if dtype is None:
                loss = mean_ce(model(x), y)
            else:
                with torch.autocast("cuda", dtype=dtype):
                    loss = mean_ce(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return run, model


def contender(name: str, precision: str, batches: list) -> Any:
    cfg = recipe_config(precision, len(batches))
    cfg.scheduler.name, cfg.scheduler.warmup_steps = "constant", 0
    if name == "raw":
        return raw_loop(cfg, batches)[0]
    cfg.train.log_every = 0
    cfg.train.clip_grad_norm = None
    cfg.train.skip_nonfinite = False
    callbacks: list = []
    if name == "hookloop+skip_nonfinite":
        cfg.train.skip_nonfinite = True
    elif name == "hookloop+clip+log10+metrics":
        cfg.train.clip_grad_norm = 1.0
        cfg.train.log_every = 10
        callbacks = [DefaultMetrics(PEAK_FLOPS)]
    return list_trainer(cfg, batches, callbacks).train


def timed_s(run) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def section_loop(args) -> None:
    names = ("hookloop-bare", "hookloop+skip_nonfinite", "hookloop+clip+log10+metrics")
    rng = random.Random(0)
    for precision in ("bf16", "fp32"):
        cfg = recipe_config(precision, args.loop_steps)
        batches = cuda_batches(cfg, args.loop_steps)
        for name in ("raw", *names):  # warm-up: kernels, autotuning, allocator
            timed_s(contender(name, precision, batches[:20]))
        raw_s: list[float] = []
        spent: dict[str, list[float]] = {n: [] for n in names}
        ratios: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.loop_rounds):
            before = timed_s(contender("raw", precision, batches))
            raw_s.append(before)
            for name in shuffled(names, rng):
                took = timed_s(contender(name, precision, batches))
                after = timed_s(contender("raw", precision, batches))
                raw_s.append(after)
                spent[name].append(took)
                ratios[name].append(took / ((before + after) / 2))
                before = after
        n = args.loop_steps
        rows = [["raw PyTorch loop", f"{median(raw_s) / n * 1e3:.3f}", "1.000", ""]]
        for name in names:
            lo, hi = quartiles(ratios[name])
            rows.append(
                [
                    name,
                    f"{median(spent[name]) / n * 1e3:.3f}",
                    f"{median(ratios[name]):.3f}",
                    f"{lo:.3f}-{hi:.3f}",
                ]
            )
        print(
            f"\n[loop, {precision}] bench/loop.py's method on CUDA: {args.loop_rounds} rounds of "
            f"{n} steps over pre-made CUDA batches (gpt-stdlib model, AdamW, mean CE)"
        )
        print(format_table(["contender", "ms/step", "x raw (median)", "IQR"], rows))


# -- memory ---------------------------------------------------------------------------------------


def peak_mib(precision: str, steps: int, **model: Any) -> tuple[float, float]:
    """(peak MiB while training, MiB once the model is on the GPU), both over what was
    allocated before (other sections' leftovers are collected first)."""
    cfg = recipe_config(precision, steps, **model)
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer = build_trainer(cfg)
    params = (torch.cuda.memory_allocated() - base) / 2**20
    trainer.train()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    return peak, params


def section_mem(args) -> None:
    models = [("gpt-stdlib default", {})] + ([("12x768, ctx 256", BIG)] if args.big else [])
    rows = []
    for label, model in models:
        base = None
        for precision in ("fp32", "bf16", "fp16"):
            peak, params = peak_mib(precision, 20, **model)
            base = base or peak
            rows.append([label, precision, f"{params:.1f}", f"{peak:.1f}", f"{peak / base:.2f}"])
    print(
        "\n[memory] torch.cuda.max_memory_allocated() over 20 training steps (batch 32), less "
        "what was allocated before the Trainer was built"
    )
    print(
        format_table(["model", "precision", "MiB after model.cuda()", "peak MiB", "x fp32"], rows)
    )


# -- launch cost ---------------------------------------------------------------------------------


def section_launch(args) -> None:
    """Why the default recipe's step takes milliseconds: kernels per step x host cost each."""
    x = torch.zeros(16, device="cuda")
    for n in (100, 3000):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            x.add_(1.0)
        torch.cuda.synchronize()
        per = (time.perf_counter() - t) / n * 1e6
    print(f"\nhost cost of one tiny CUDA op (x.add_(1.0), 3000 in a row): {per:.1f} us")
    for precision in ("bf16", "fp32"):
        cfg = recipe_config(precision, 30)
        batches = cuda_batches(cfg, 30)
        run, _ = raw_loop(cfg, batches[:10])
        run()
        _, model = raw_loop(cfg, batches)
        parts = {"forward+loss": 0.0, "backward": 0.0, "optimizer": 0.0}
        opt = build_optimizer(cfg.optimizer, model)
        dtype = torch.bfloat16 if precision == "bf16" else None
        for i, (xb, yb) in enumerate(batches):
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = mean_ce(model(xb), yb)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if i >= 10:
                parts["forward+loss"] += t1 - t0
                parts["backward"] += t2 - t1
                parts["optimizer"] += t3 - t2
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for xb, yb in batches[:5]:
                with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=bool(dtype)):
                    loss = mean_ce(model(xb), yb)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = sum(e.count for e in events if e.device_type.name == "CUDA") / 5
        gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
        host = {k: v / 20 * 1e3 for k, v in parts.items()}
        print(
            f"raw loop, {precision}: {kernels:.0f} GPU kernels/step, GPU busy "
            f"{gpu_us / 5 / 1e3:.2f} ms/step; host ms/step "
            + ", ".join(f"{k} {v:.2f}" for k, v in host.items())
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--big", action="store_true", help="also the 12-layer GPU-bound model")
    parser.add_argument("--sleep-ms", type=float, default=100.0)
    parser.add_argument("--recipe-only", action="store_true", help="sync: the recipe cases")
    parser.add_argument("--ckpt-rounds", type=int, default=5)
    parser.add_argument("--loop-rounds", type=int, default=5)
    parser.add_argument("--loop-steps", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("bench/gpu.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # torch's default, stated
    props = torch.cuda.get_device_properties(0)
    print(
        f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}; python {sys.version.split()[0]}"
    )
    for section in args.only.split(","):
        began = time.perf_counter()
        print(f"\n=== {section} ===", flush=True)
        {"sync": section_sync, "ckpt": section_ckpt, "mfu": section_mfu, "loop": section_loop,
         "mem": section_mem, "launch": section_launch}[section](args)  # fmt: skip
        print(f"({section}: {time.perf_counter() - began:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
