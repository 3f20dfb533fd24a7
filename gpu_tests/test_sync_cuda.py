"""No host-device sync inside a training step on CUDA: the loop keeps losses, grad norm
and token counts on the device and reads them back once per log (README, "Hot-path
rules"); ``train.skip_nonfinite`` is documented as the one host read per step.

Two probes: ``torch.cuda.set_sync_debug_mode("warn")``, each flagged sync attributed to
its step and to the innermost hookloop frame; and a GPU sleep queued as each step starts,
which catches waits torch does not flag (a copy from pageable host memory)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from _cuda import Phase, SleepProbe, flagged_syncs, gpt_trainer

assert torch.cuda.is_available(), "gpu_tests/ needs a CUDA device"

STEPS, LOG_EVERY = 16, 4
SLEEP_MS = 100.0  # far above a step's host time (~5-20 ms here): a step that waited shows
LOG_STEPS = set(range(LOG_EVERY, STEPS + 1, LOG_EVERY))


def syncs_of_a_run(**train: Any) -> tuple[Any, list[tuple[int, bool, str]]]:
    """Train the small GPT; assert no sync inside a step and one at each log boundary.
    Returns the result and the flagged syncs."""
    phase = Phase()
    trainer = gpt_trainer(STEPS, [phase], log_every=LOG_EVERY, **train)
    with flagged_syncs(trainer, phase) as syncs:
        result = trainer.train()
    inside = [(step, at) for step, is_inside, at in syncs if is_inside]
    assert inside == [], f"syncs inside training steps: {inside}"
    at_boundaries = Counter(step for step, is_inside, _ in syncs if not is_inside and step)
    assert at_boundaries == dict.fromkeys(LOG_STEPS, 1), f"syncs per step boundary: {syncs}"
    return result, syncs


def test_no_sync_inside_a_step_and_one_read_back_per_log():
    result, syncs = syncs_of_a_run()
    places = {at for _, _, at in syncs}
    assert len(places) == 1, f"not the same read-back at each log: {syncs}"
    assert "_log < _act_at_boundary" in places.pop(), f"not read back in _log: {syncs}"
    assert result.step == STEPS and result.logs["loss"] > 0 and result.logs["grad_norm"] > 0


def test_a_step_does_not_wait_for_the_gpu():
    probe = SleepProbe(ms=SLEEP_MS, every=LOG_EVERY)
    gpt_trainer(STEPS, [probe], log_every=LOG_EVERY).train()
    torch.cuda.synchronize()
    assert probe.probed() == [5, 9, 13]
    assert probe.waited() == [], f"host ms per probed step: {probe.host_ms}"


def test_skip_nonfinite_is_one_host_read_per_step():
    phase = Phase()
    trainer = gpt_trainer(STEPS, [phase], log_every=LOG_EVERY, skip_nonfinite=True)
    with flagged_syncs(trainer, phase) as syncs:
        trainer.train()
    per_step = Counter(step for step, is_inside, _ in syncs if is_inside)
    assert per_step == dict.fromkeys(range(1, STEPS + 1), 1), syncs
    assert all("any_nonfinite" in at for _, is_inside, at in syncs if is_inside), syncs
    probe = SleepProbe(ms=SLEEP_MS, every=LOG_EVERY)
    gpt_trainer(STEPS, [probe], log_every=LOG_EVERY, skip_nonfinite=True).train()
    assert probe.waited() == [5, 9, 13], f"host ms per probed step: {probe.host_ms}"


def test_a_fused_optimizer_skips_nonfinite_without_a_sync_inside_a_step():
    """With a fused optimizer the non-finite verdict is the device's: no read in a step,
    one read-back per log (the skips are counted with the losses)."""
    result, _ = syncs_of_a_run(skip_nonfinite=True, fused=True)
    assert result.logs["skipped_steps"] == 0
    probe = SleepProbe(ms=SLEEP_MS, every=LOG_EVERY)
    gpt_trainer(STEPS, [probe], log_every=LOG_EVERY, skip_nonfinite=True, fused=True).train()
    assert probe.waited() == [], f"host ms per probed step: {probe.host_ms}"


def test_the_default_recipe_step_does_not_sync_either():
    """``gpt-stdlib`` through ``build_trainer``: its DataLoader and its forward step,
    ``skip_nonfinite=false``."""
    from hookloop.entry import build_trainer
    from hookloop.recipes import default_config

    cfg = default_config("gpt-stdlib")
    for key, value in {
        "device": "cuda", "precision": "bf16", "max_steps": STEPS, "log_every": LOG_EVERY,
        "eval_every": None, "eval_at_epoch_end": False, "handle_signals": False,
        "skip_nonfinite": False,
    }.items():  # fmt: skip
        setattr(cfg.train, key, value)
    cfg.checkpoint.every = None
    phase = Phase()
    trainer = build_trainer(cfg, callbacks=[phase])
    with flagged_syncs(trainer, phase) as syncs:
        trainer.train()
    inside = Counter(at for step, is_inside, at in syncs if is_inside and step > 1)
    probe = SleepProbe(ms=SLEEP_MS, every=LOG_EVERY)
    build_trainer(cfg, callbacks=[probe]).train()
    waited = probe.waited()
    assert not inside and not waited, (
        f"flagged syncs inside steps 2..{STEPS}: {dict(inside)}; steps that waited for a "
        f"{probe.ms} ms GPU sleep: {waited} (host ms {probe.host_ms})"
    )
