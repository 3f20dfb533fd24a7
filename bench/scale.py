"""What hookloop's control costs per ordinary step at 2 to 32 gloo ranks, counted and timed.

hookloop agrees its control decisions (stop, save, log, evaluate, a live ``set``, the
non-finite skip, ...) across ranks with small collectives. For each world size this
starts that many processes (``torch.multiprocessing`` spawn, gloo on 127.0.0.1, a free
port, a deadline per size; every child is reaped), and on every rank:

1. **counts** (``hookloop.testing.count_sync_points``): the native loop on the
   ``mlp-regression`` recipe (logging, evaluation and checkpoints out of the way, so
   ordinary steps dominate) for ``--steps`` steps; per ordinary step, the collectives
   and host reads this rank made and the bytes of tensors it handed to collectives.
   The same count of the raw loop below shows what DDP's Python side adds (nothing
   expected: its gradient all-reduce runs in its C++ reducer and is not counted);
2. **times** (only while ranks <= cores; beyond that time measures the scheduler): per
   round, ``--timed-steps`` steps each of the native loop, a raw loop over the same
   model, data and DDP with no hookloop ("control off"), and that raw loop plus as many
   small all-reduces a step as were counted, each read back (``raw+agree``: what the
   agreement's collectives cost alone), in an order rotated each round; ratios are
   taken within a round, the median over rounds is shown.

Per size it prints the median over ordinary steps of each rank's counts (one figure
when every rank agrees, else ``min-max`` over ranks). Then it projects the control cost
to 1,024, 4,096 and 16,384 ranks: collectives per step times the small-message
all-reduce latency of NCCL's own tuning model (see ``LATENCY_MODEL``), a model, not a
measurement.

    python bench/scale.py                  # 2, 4, 8, 16 ranks (~3-6 min on 2 cores)
    python bench/scale.py --max            # and 32
    python bench/scale.py --quick          # 2 and 4 ranks, fewer steps (~30 s)
    python bench/scale.py --quick --no-time --sizes 2   # counts only (the smoke test's run)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from _timing import environment, format_table
from hookloop.config import apply_overrides
from hookloop.distributed import leave_process_group
from hookloop.entry import build_trainer, seed_everything
from hookloop.recipes import default_config, get_recipe
from hookloop.testing import count_sync_points

#: NCCL's tuning model of a small all-reduce (tree algorithm, LL protocol), the latency
#: NCCL itself uses to pick an algorithm: ``base + 2 * ((ppn - 1) * nvlink + log2(nodes)
#: * net)`` microseconds. A model with NCCL's constants, not a measurement.
LATENCY_MODEL = {
    "source": "NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel "
    "(commit b6475625fbcaa2c3c0e50eed2fa1255d7514d4a2)",
    "base_us": 6.8,  # baseLat[Tree][LL]
    "nvlink_hop_us": 0.6,  # hwLat[NVLINK][Tree][LL]
    "net_hop_us": 5.0,  # hwLat[NET][Tree][LL]
    "gpus_per_node": 8,
}
PROJECTED_SIZES = (1024, 4096, 16384)


@dataclass(frozen=True)
class Plan:
    """What every rank of one size does (picklable: it crosses the spawn)."""

    world: int
    port: int
    out_dir: str
    steps: int  # counted steps of the native loop
    timed: bool
    timed_steps: int
    rounds: int
    batch_size: int
    timeout_s: float
    fused: bool = False  # torch's fused AdamW: the non-finite verdict on the device


# -- one rank ------------------------------------------------------------------------
def rank_main(rank: int, plan: Plan) -> None:
    """A spawned rank: join the group, count, time, write ``rank<r>.json``, leave."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(plan.world), LOCAL_RANK=str(rank),
                      GLOO_SOCKET_IFNAME="lo")  # fmt: skip
    torch.set_num_threads(1)
    timeout = timedelta(seconds=plan.timeout_s)
    # The store lives in the parent, so no rank's exit takes it from the others.
    store = dist.TCPStore("127.0.0.1", plan.port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=plan.world, timeout=timeout)
    result: dict[str, Any] = {"rank": rank, "hookloop": count_native(plan)}
    result["raw"] = count_raw(plan)
    if plan.timed:
        result["timing"] = time_rounds(plan, result["hookloop"])
    Path(plan.out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    leave_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past torch's interpreter teardown, which can abort a gloo rank (SIGABRT)


def native_trainer(plan: Plan, steps: int) -> Any:
    """The native loop on mlp-regression, with nothing due on ordinary steps."""
    cfg = default_config("mlp-regression")
    apply_overrides(cfg, overrides(plan, steps))
    return build_trainer(cfg)


def overrides(plan: Plan, steps: int) -> list[str]:
    samples = (steps + 1) * plan.batch_size * plan.world  # one epoch holds every step
    return [
        f"train.max_steps={steps}", "train.log_every=1000000", "train.eval_every=1000000",
        "train.eval_at_epoch_end=false", f"data.batch_size={plan.batch_size}",
        f"data.train_samples={samples}", "data.eval_samples=8", "train.device=cpu",
        *(["optimizer.kwargs={fused: true}"] if plan.fused else []),
    ]  # fmt: skip


def count_native(plan: Plan) -> dict[str, Any]:
    trainer = native_trainer(plan, plan.steps)
    with count_sync_points() as counts:
        trainer.callbacks.add(counts.marker)
        trainer.train()
    return summarise([asdict(s) for s in counts.ordinary_steps()])


class RawLoop:
    """Control off: the same model, data and optimizer under DDP, and no hookloop. With
    ``agreements`` (count, bytes), also that many small all-reduces a step, each read
    back: the collectives hookloop's control makes, alone."""

    def __init__(self, plan: Plan, steps: int, agreements: tuple[int, int] = (0, 0)) -> None:
        cfg = default_config("mlp-regression")
        apply_overrides(cfg, overrides(plan, steps))
        seed_everything(cfg.seed)
        parts = get_recipe(cfg.recipe).build(cfg)
        self.model = DistributedDataParallel(parts.model)
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=cfg.optimizer.lr, momentum=cfg.optimizer.momentum
        )
        sampler = DistributedSampler(parts.train_data, shuffle=True, seed=cfg.seed)
        self.data = DataLoader(parts.train_data, batch_size=plan.batch_size, sampler=sampler)
        self.loss_fn, self.steps = parts.loss_fn, steps
        count, payload = agreements  # all-reduces a step, and their bytes together
        words = max(1, payload // (8 * count)) if count else 0
        self.flags = [torch.zeros(words, dtype=torch.int64) for _ in range(count)]

    def run(self, on_step_start: Any = None) -> None:
        model, optimizer, loss_fn = self.model, self.optimizer, self.loss_fn
        for step, (x, y) in enumerate(self.data):
            if step == self.steps:
                break
            if on_step_start is not None:
                on_step_start(step)
            loss = loss_fn(model(x), y)
            loss.backward()
            for flags in self.flags:  # what agreeing decisions costs, without the rest
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                flags.tolist()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def count_raw(plan: Plan) -> dict[str, Any]:
    loop = RawLoop(plan, min(plan.steps, 20))
    with count_sync_points() as counts:

        def close_previous(step: int) -> None:
            if step:  # step 0 holds DDP's first-iteration work: not ordinary, as natively
                counts.close_step(step - 1, ordinary=step > 1)

        loop.run(close_previous)
    return summarise([asdict(s) for s in counts.ordinary_steps()])


def summarise(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Median per ordinary step of this rank's counts, and a typical step's names."""
    if not steps:
        return {"steps": 0}
    collectives = [sum(s["collectives"].values()) for s in steps]
    reads = [sum(s["host_reads"].values()) for s in steps]
    typical = steps[len(steps) // 2]
    return {
        "steps": len(steps),
        "collectives": statistics.median(collectives),
        "host_reads": statistics.median(reads),
        "payload_bytes": statistics.median(s["payload_bytes"] for s in steps),
        "collective_names": typical["collectives"],
        "host_read_names": typical["host_reads"],
    }


CONTENDERS = ("native", "raw", "raw+agree")


def time_rounds(plan: Plan, counted: dict[str, Any]) -> list[dict[str, float]]:
    """Per round, seconds per step of each contender (this rank's wall clock from the start
    of step ``warm`` to the start of the last step), in an order rotated each round."""
    warm, rounds = min(10, plan.timed_steps // 4), []
    agreements = (round(counted["collectives"]), int(counted["payload_bytes"]))
    for index in range(plan.rounds):
        order = CONTENDERS[index % 3 :] + CONTENDERS[: index % 3]  # the same on every rank
        rounds.append({name: seconds_per_step(name, plan, warm, agreements) for name in order})
    return rounds


def seconds_per_step(name: str, plan: Plan, warm: int, agreements: tuple[int, int]) -> float:
    stamps: list[float] = []
    if name == "native":
        trainer = native_trainer(plan, plan.timed_steps)
        trainer.callbacks.register(
            "on_train_step_start", lambda ctx: stamps.append(time.perf_counter())
        )
        dist.barrier()
        trainer.train()
    else:
        loop = RawLoop(plan, plan.timed_steps, agreements if name == "raw+agree" else (0, 0))
        dist.barrier()
        loop.run(lambda step: stamps.append(time.perf_counter()))
    return (stamps[-1] - stamps[warm]) / (len(stamps) - 1 - warm)


# -- the parent ----------------------------------------------------------------------
def run_size(world: int, args: argparse.Namespace, timed: bool) -> list[dict[str, Any]] | str:
    """Every rank's result at one world size, or a line saying why there is none."""
    with tempfile.TemporaryDirectory(prefix="hookloop-scale-") as out_dir:
        # The rendezvous store, on a free port of 127.0.0.1, held here until every rank is gone.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        plan = Plan(world, store.port, out_dir, args.steps, timed, args.timed_steps,
                    args.rounds, args.batch_size, args.timeout, args.fused)  # fmt: skip
        context = mp.start_processes(rank_main, args=(plan,), nprocs=world, join=False,
                                     start_method="spawn")  # fmt: skip
        deadline, failure = time.monotonic() + args.timeout, None
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    failure = f"timed out after {args.timeout:.0f} s"
                    break
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            failure = f"a rank failed: {str(err).strip().splitlines()[-1]}"
        finally:
            for process in context.processes:  # reap every child, whatever happened
                if process.is_alive():
                    process.kill()
                process.join()
        if failure:
            return failure
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]


def spread(values: list[float], fmt: str = "{:g}") -> str:
    """One figure when every rank agrees, else ``min-max`` over ranks."""
    low, high = min(values), max(values)
    return fmt.format(low) if low == high else f"{fmt.format(low)}-{fmt.format(high)}"


def names(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {c}" for n, c in sorted(counts.items())) or "-"


def count_row(world: int, ranks: list[dict[str, Any]] | str) -> list[str]:
    if isinstance(ranks, str):
        return [str(world), ranks]
    native = [r["hookloop"] for r in ranks]
    raw = [r["raw"] for r in ranks]
    return [
        str(world),
        spread([n["collectives"] for n in native]),
        names(native[0]["collective_names"]),
        spread([n["host_reads"] for n in native]),
        names(native[0]["host_read_names"]),
        spread([n["payload_bytes"] for n in native]),
        f"{spread([r['collectives'] for r in raw])} / {spread([r['host_reads'] for r in raw])}",
    ]


def time_row(world: int, ranks: list[dict[str, Any]] | str, cores: int) -> list[str]:
    timing = None if isinstance(ranks, str) else ranks[0].get("timing")
    if timing is None:
        why = "not timed: more ranks than cores" if world > cores else "not timed"
        return [str(world), *["-"] * 5, "0", why]
    ms = [f"{statistics.median(t[c] for t in timing) * 1e3:.3f}" for c in CONTENDERS]
    native = statistics.median(t["native"] / t["raw"] for t in timing)
    agree = statistics.median(t["raw+agree"] / t["raw"] for t in timing)
    return [str(world), *ms, f"{native:.2f}x", f"{agree:.2f}x", str(len(timing)), ""]


def allreduce_latency_us(ranks: int) -> float:
    m = LATENCY_MODEL
    per_node = min(ranks, m["gpus_per_node"])
    nodes = max(1, ranks // per_node)
    return m["base_us"] + 2 * (
        (per_node - 1) * m["nvlink_hop_us"] + math.log2(nodes) * m["net_hop_us"]
    )


def projection(collectives_per_step: float) -> str:
    m = LATENCY_MODEL
    rows = []
    for ranks in PROJECTED_SIZES:
        latency = allreduce_latency_us(ranks)
        cost = collectives_per_step * latency
        rows.append([str(ranks), str(ranks // m["gpus_per_node"]), f"{latency:.1f}",
                     f"{cost:.1f}", f"{cost / 1e5:.2%}", f"{cost / 1e6:.3%}"])  # fmt: skip
    table = format_table(
        ["ranks", "nodes", "all-reduce us (model)", "control us/step", "of a 100 ms step",
         "of a 1 s step"], rows,
    )  # fmt: skip
    return (
        f"Projected control cost: {collectives_per_step:g} small all-reduce(s) per ordinary "
        f"step x the latency of NCCL's tuning model (a MODEL, not a measurement):\n"
        f"  latency_us = {m['base_us']} + 2 * ((ppn - 1) * {m['nvlink_hop_us']} + "
        f"log2(nodes) * {m['net_hop_us']}), ppn = {m['gpus_per_node']} GPUs a node\n"
        f"  (tree algorithm, LL protocol; constants baseLat / hwLat from {m['source']})\n"
        f"{table}\n"
        "Host reads do not grow with the number of ranks; on a GPU each one is a "
        "device sync (see bench/gpu.py for what one costs)."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", help="world sizes, comma-separated (default 2,4,8,16)")
    parser.add_argument("--max", action="store_true", help="also 32 ranks")
    parser.add_argument("--quick", action="store_true", help="2 and 4 ranks, fewer steps")
    parser.add_argument("--no-time", action="store_true", help="count only")
    parser.add_argument("--steps", type=int, default=40, help="counted steps per size")
    parser.add_argument("--timed-steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per size")
    parser.add_argument("--json", help="also write every rank's result here")
    parser.add_argument(
        "--fused", action="store_true", help="fused AdamW (the non-finite verdict on the device)"
    )
    args = parser.parse_args(argv)
    if args.steps < 4 or args.timed_steps < 8 or args.rounds < 1:
        parser.error("--steps must be >= 4, --timed-steps >= 8 and --rounds >= 1")
    default = "2,4" if args.quick else "2,4,8,16"
    sizes = [int(s) for s in (args.sizes or default).split(",")]
    if args.quick:
        args.steps, args.timed_steps, args.rounds = 16, 120, 3
    if args.max and 32 not in sizes:
        sizes.append(32)
    cores = os.cpu_count() or 1
    print(f"# hookloop control cost per ordinary step, gloo on CPU; {environment()}", flush=True)
    results: dict[int, Any] = {}
    for world in sizes:
        started = time.monotonic()
        results[world] = run_size(world, args, timed=not args.no_time and world <= cores)
        print(f"  {world} ranks: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    headers = ["ranks", "collectives/step", "by name", "host reads/step", "by name",
               "payload B/step", "raw loop coll / reads"]  # fmt: skip
    print(format_table(headers, [count_row(w, r) for w, r in results.items()]), flush=True)
    print("\nWall ms per step on rank 0 (median over rounds; ratios taken within a round):")
    headers = ["ranks", "native ms", "raw ms", "raw+agree ms", "native/raw", "raw+agree/raw",
               "rounds", "note"]  # fmt: skip
    print(format_table(headers, [time_row(w, r, cores) for w, r in results.items()]), flush=True)
    counted = [r for r in results.values() if not isinstance(r, str)]
    if counted:
        print()
        print(projection(max(max(x["hookloop"]["collectives"] for x in r) for r in counted)))
    if args.json:
        Path(args.json).write_text(json.dumps({str(w): r for w, r in results.items()}, indent=1))
    return 0 if len(counted) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
