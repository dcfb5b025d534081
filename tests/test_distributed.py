"""SlotTrainer under DistributedDataParallel: two CPU ranks (gloo), each with its own batch of other slots.

DDP averages the stacks' gradients over the ranks, so a slot with tokens on one rank gets a gradient on
every rank; SlotTrainer.step must then let the optimizer move it on every rank, or the ranks' stacks drift
apart (they did: 3.7e-2 after 3 steps). Checked: with the trainer's default group the two ranks end bit for
bit equal, and equal (to float32 rounding) to one process stepping on both batches' averaged gradients; with
``process_group=None`` (ranks independent) they differ, which is what the group is for.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lora_ops import training
from test_batch_copies import adamw_steps, inputs, make_model

WORLD, STEPS = 2, 3
BATCHES = ([("a", 7), (None, 5)], [("b", 6), ("c", 6)])   # rank 0's slots and rank 1's: none shared


def rank_loss(model, ctx, step, rank):
    x, w = inputs(10 * step + rank)
    ctx.set_batch(BATCHES[rank])
    return (model(x) * w).sum()


def worker(rank, init_file, process_group, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model, ctx, trainer = make_model()
        if process_group is None:
            trainer.process_group = None          # as ctx.train_slots(..., process_group=None)
        else:
            assert training._data_parallel_group(trainer.process_group) is dist.group.WORLD
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        stacks = adamw_steps(trainer, lambda step: rank_loss(ddp, ctx, step, rank).backward(), STEPS)
        torch.save(stacks, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()                    # both ranks' results written
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without tearing gloo down: its threads' teardown at exit aborted a rank now and then ("terminate
    # called without an active exception", 1 run in ~10; 1 in 40 even after a barrier), after the results
    # were written. Nothing is left to clean up in a process that ends here.
    os._exit(0)


def run_ranks(tmp_path, process_group):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.spawn(worker, args=(str(tmp_path / "init"), process_group, str(tmp_path)), nprocs=WORLD)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


def test_data_parallel_ranks_step_the_same_slots(tmp_path):
    rank0, rank1 = run_ranks(tmp_path, "default")
    assert torch.equal(rank0, rank1)
    model, ctx, trainer = make_model()

    def both_ranks(step):      # DDP's gradient: the mean over the ranks
        for rank in range(WORLD):
            (rank_loss(model, ctx, step, rank) / WORLD).backward()
    one_process = adamw_steps(trainer, both_ranks, STEPS)
    torch.testing.assert_close(rank0, one_process, rtol=1e-5, atol=1e-6)


def test_independent_ranks_drift_apart(tmp_path):
    rank0, rank1 = run_ranks(tmp_path, None)
    assert not torch.equal(rank0, rank1)
