"""SlotTrainer under DistributedDataParallel: two CPU ranks (gloo), each with its own batch of other slots.

DDP averages the stacks' gradients over the ranks, so a slot with tokens on one rank gets a gradient on
every rank; SlotTrainer.step must then let the optimizer move it on every rank, or the ranks' stacks drift
apart (they did: 3.7e-2 after 3 steps). Checked: with the trainer's default group the two ranks end bit for
bit equal, and equal (to float32 rounding) to one process stepping on both batches' averaged gradients; with
``process_group=None`` (ranks independent) they differ, which is what the group is for; with a group given
(each rank's own, of itself alone) the trainer reduces over that group, not the world: each rank steps as
under ``None``, bit for bit. At one step rank 0's batch takes no adapter: its trainer saw no gradient yet
must join the all-reduce (every rank calls ``step`` alike) and move rank 1's slots.
All modes run in one spawn of the two ranks (their start-up is most of the time).
"""
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lora_ops import training
from test_batch_copies import adamw_steps, inputs, make_model

WORLD, STEPS = 2, 3
BATCHES = ([("a", 7), (None, 5)], [("b", 6), ("c", 6)])   # rank 0's slots and rank 1's: none shared
NO_ADAPTER_STEP = 1     # rank 0's batch at this step: every token without an adapter (rank 1's as always)
# The trainer's process_group in each run: the default group, none, and a group of the rank alone.
MODES = ("default", "none", "own_rank")
# A rank left waiting in a collective (one skipped on the other rank) fails the test in a minute, not gloo's 30.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def rank_batch(step, rank):
    return [(None, 12)] if (step, rank) == (NO_ADAPTER_STEP, 0) else BATCHES[rank]   # (12: inputs()'s tokens)


def rank_loss(model, ctx, step, rank):
    x, w = inputs(10 * step + rank)
    ctx.set_batch(rank_batch(step, rank))
    return (model(x) * w).sum()


def worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        own_rank_groups = [dist.new_group([r]) for r in range(WORLD)]   # (every rank creates every group)
        for mode in MODES:
            model, ctx, trainer = make_model()
            if mode == "none":
                trainer.process_group = None          # as ctx.train_slots(..., process_group=None)
            elif mode == "own_rank":
                trainer.process_group = own_rank_groups[rank]
            else:
                assert training._data_parallel_group(trainer.process_group) is dist.group.WORLD
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            stacks = adamw_steps(trainer, lambda step: rank_loss(ddp, ctx, step, rank).backward(), STEPS)
            torch.save(stacks, os.path.join(out_dir, f"{mode}-rank{rank}.pt"))
        dist.barrier()                    # both ranks' results written
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without tearing gloo down: its threads' teardown at exit aborted a rank now and then ("terminate
    # called without an active exception", 1 run in ~10; 1 in 40 even after a barrier), after the results
    # were written. Nothing is left to clean up in a process that ends here.
    os._exit(0)


@pytest.fixture(scope="module")
def ranks_stacks(tmp_path_factory):
    """{mode: [rank 0's stacks, rank 1's]} after the steps, every mode of MODES run by one spawn of the ranks."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out_dir = tmp_path_factory.mktemp("ranks")
    mp.spawn(worker, args=(str(out_dir / "init"), str(out_dir)), nprocs=WORLD)
    return {mode: [torch.load(out_dir / f"{mode}-rank{r}.pt") for r in range(WORLD)] for mode in MODES}


def test_data_parallel_ranks_step_the_same_slots(ranks_stacks):
    rank0, rank1 = ranks_stacks["default"]
    assert torch.equal(rank0, rank1)
    model, ctx, trainer = make_model()

    def both_ranks(step):      # DDP's gradient: the mean over the ranks
        for rank in range(WORLD):
            (rank_loss(model, ctx, step, rank) / WORLD).backward()
    one_process = adamw_steps(trainer, both_ranks, STEPS)
    torch.testing.assert_close(rank0, one_process, rtol=1e-5, atol=1e-6)


def test_independent_ranks_drift_apart(ranks_stacks):
    rank0, rank1 = ranks_stacks["none"]
    assert not torch.equal(rank0, rank1)


def test_a_group_given_is_the_one_reduced_over(ranks_stacks):
    """Each rank's group of itself alone: no other rank's slots move on it, exactly as with no group (a trainer
    that reduced over the world instead would step both ranks alike)."""
    for own_rank, independent in zip(ranks_stacks["own_rank"], ranks_stacks["none"]):
        assert torch.equal(own_rank, independent)
