"""hookloop.testing.count_sync_points: it counts the collectives and host reads a block
makes, per training step, and leaves torch as it found it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _dist_launch import torchrun
from hookloop import Config, DataConfig, TrainConfig, Trainer
from hookloop.testing import HOST_READS, TinyModel, ToyData, count_sync_points

ROOT = Path(__file__).resolve().parents[1]


def test_counts_each_kind_of_host_read_and_nothing_after_the_block():
    x = torch.arange(4.0)
    with count_sync_points() as counts:
        for _ in range(3):
            x.sum().item()
        x.tolist(), x[:2].tolist()
        if x[1]:  # Tensor.__bool__
            float(x[2]), int(x[3])
        x.cpu().numpy()  # .cpu() counts on every device: the same line waits on a GPU
    assert dict(counts.host_reads) == {"item": 3, "tolist": 2, "__bool__": 1, "__float__": 1,
                                       "__int__": 1, "cpu": 1, "numpy": 1}  # fmt: skip
    x[0].item()
    assert counts.host_reads["item"] == 3  # the block is over: nothing counts any more
    assert not counts.collectives


def test_restores_torch_after_an_error_inside_the_block():
    before = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    all_reduce = dist.all_reduce
    with pytest.raises(KeyError), count_sync_points():
        assert torch.Tensor.item is not before["item"]  # replaced inside
        raise KeyError("a failure inside the block")
    assert {name: getattr(torch.Tensor, name) for name in HOST_READS} == before
    assert not any(name in vars(torch.Tensor) for name in HOST_READS)  # inherited again
    assert dist.all_reduce is all_reduce and dist.distributed_c10d.all_reduce is all_reduce
    with count_sync_points() as counts:  # usable again
        torch.ones(1).item()
    assert counts.host_reads["item"] == 1


def test_a_second_block_inside_the_first_is_refused():
    refused = pytest.raises(RuntimeError, match="already counting")
    with count_sync_points(), refused, count_sync_points():
        pass


@pytest.fixture
def one_rank_group(monkeypatch):
    """A gloo group of one process, so collectives run in this process."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_counts_collectives_by_name_once_each_with_their_tensor_bytes(one_rank_group):
    flags = torch.zeros(4, dtype=torch.int64)
    with count_sync_points() as counts:
        dist.all_reduce(flags)
        dist.all_reduce(tensor=flags, op=dist.ReduceOp.MAX)
        dist.distributed_c10d.broadcast(torch.zeros(3), src=0)  # the module torch defines it in
        out: list[object] = [None]
        dist.all_gather_object(out, {"stop": "why"})  # its own all_gather and item() not counted
        dist.barrier()
    assert dict(counts.collectives) == {"all_reduce": 2, "broadcast": 1, "all_gather_object": 1,
                                        "barrier": 1}  # fmt: skip
    assert counts.payload_bytes == 2 * 4 * 8 + 3 * 4  # the tensors handed over; objects not
    assert not counts.host_reads
    assert out == [{"stop": "why"}]


def read_twice(ctx) -> None:
    """Two host reads in every step."""
    ctx.loss_dict["loss"].item()
    ctx.loss_dict["loss"].detach().tolist()


def steps_of(run_extra: bool) -> dict[int, tuple[bool, int, int]]:
    cfg = Config(train=TrainConfig(max_steps=7, log_every=3), data=DataConfig(batch_size=4))
    trainer = Trainer(TinyModel(), train_data=ToyData(n=64), loss_fn=TinyModel.loss_fn,
                      config=cfg)  # fmt: skip
    if run_extra:
        trainer.callbacks.register("on_after_optimizer_step", read_twice)
    with count_sync_points() as counts:
        trainer.callbacks.add(counts.marker)
        trainer.train()
    return {s: (r.ordinary, r.n_host_reads, r.n_collectives) for s, r in counts.steps.items()}


def test_per_step_windows_follow_the_trainer_and_say_which_steps_are_ordinary():
    plain, extra = steps_of(False), steps_of(True)
    assert sorted(plain) == list(range(1, 8))
    # Not ordinary: the first step, the logging steps 3 and 6, the last (training's end).
    assert [s for s, (ordinary, _, _) in plain.items() if ordinary] == [2, 4, 5]
    for step in (2, 4, 5):
        assert extra[step][1] - plain[step][1] == 2  # exactly the two reads added per step
        assert plain[step][1] == plain[2][1]  # every ordinary step alike
    assert all(collectives == 0 for _, _, collectives in plain.values())  # one process


TWO_RANK_JOB = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    from hookloop.config import apply_overrides
    from hookloop.distributed import init_from_env, leave_process_group, rank_info
    from hookloop.entry import build_trainer
    from hookloop.recipes import default_config
    from hookloop.testing import count_sync_points

    def build(*extra):
        cfg = default_config("mlp-regression")
        apply_overrides(cfg, ["train.max_steps=6", "train.log_every=1000", "train.eval_every=1000",
                              "train.eval_at_epoch_end=false", "data.batch_size=8", *extra])
        return build_trainer(cfg)

    def per_step(counts):
        return {s: [r.ordinary, r.collectives, r.host_reads] for s, r in counts.steps.items()}

    init_from_env()
    rank = rank_info()[0]
    trainer = build()
    with count_sync_points() as counts:
        flags = torch.tensor([rank, 1 - rank])
        dist.all_reduce(flags)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        box = [rank] if rank == 0 else [None]
        dist.broadcast_object_list(box, src=0)
        reads = [flags[0].item() for _ in range(3)] + [flags.tolist()]
        known = counts.close_step(0, ordinary=False)
        trainer.callbacks.add(counts.marker)
        trainer.train()
    out = {"known": [known.collectives, known.host_reads, known.payload_bytes],
           "steps": per_step(counts)}
    fused = build("optimizer.kwargs={fused: true}")
    poisoned = {"on": False}  # rank 1's loss is NaN at step 4: DDP makes every gradient NaN
    fused.model.register_forward_hook(
        lambda module, args, output: output * float("nan") if poisoned["on"] else output)
    fused.callbacks.register(
        "on_train_step_start",
        lambda ctx: poisoned.update(on=rank == 1 and ctx.state.step == 3))
    with count_sync_points() as counts:
        fused.callbacks.add(counts.marker)
        fused.train()
    out["fused"] = per_step(counts)
    out["fused_skipped"] = fused.progress.skipped_steps
    out["fused_weights"] = [p.detach().double().sum().item() for p in fused.model.parameters()]
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    leave_process_group()
    os._exit(0)
    """
)


@pytest.mark.slow
def test_two_gloo_ranks_count_the_same_known_collectives_and_the_agreement_each_step(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(TWO_RANK_JOB)
    proc = subprocess.run([*torchrun(2), str(job), str(tmp_path)], capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in ranks:
        collectives, reads, payload = result["known"]
        assert collectives == {"all_reduce": 2, "broadcast_object_list": 1}
        assert reads == {"item": 3, "tolist": 1}
        assert payload == 2 * 2 * 8  # two all-reduces of two int64; the object list not counted
        steps = result["steps"]
        assert sorted(steps, key=int) == [str(s) for s in range(7)]
        ordinary = {s: v for s, v in steps.items() if v[0]}
        assert sorted(ordinary, key=int) == ["2", "3", "4", "5"]
        for _, collectives, reads in ordinary.values():
            # Every decision of the step in one all-reduce, read from host memory; one
            # scalar read back: the non-finite verdict (one however many gradients).
            assert collectives == {"all_reduce": 1}
            assert reads == {"item": 1}
        # A fused optimizer takes the verdict on the device: nothing read back at all.
        fused = {s: v for s, v in result["fused"].items() if v[0]}
        assert sorted(fused, key=int) == ["2", "3", "4", "5"]
        assert all(v[1:] == [{"all_reduce": 1}, {}] for v in fused.values()), fused
        assert result["fused_skipped"] == 1  # the NaN step, skipped on both ranks
    assert ranks[0]["steps"] == ranks[1]["steps"]  # both ranks did the same, step by step
    assert ranks[0]["fused"] == ranks[1]["fused"]
    assert ranks[0]["fused_weights"] == ranks[1]["fused_weights"]


@pytest.mark.slow
def test_the_scale_benchmark_prints_the_counts_table_at_two_ranks(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "scale.py"), "--quick", "--no-time",
           "--sizes", "2", "--timeout", "200", "--json", str(tmp_path / "scale.json")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("ranks  collectives/step"))
    row = lines[header + 2].split()
    result = json.loads((tmp_path / "scale.json").read_text())["2"]
    assert [r["rank"] for r in result] == [0, 1]
    assert row[0] == "2" and float(row[1]) == result[0]["hookloop"]["collectives"] >= 1
    assert float(row[row.index("all_reduce") + 2]) == result[0]["hookloop"]["host_reads"]
    timing = next(i for i, line in enumerate(lines) if line.startswith("ranks  native ms"))
    assert lines[timing + 2].split()[0] == "2" and lines[timing + 2].endswith("not timed")
    assert "Projected control cost" in proc.stdout and "16384" in proc.stdout
