"""rock_online statistics are summed across processes: two gloo ranks on half a batch each hold the same rock set,
equal to what one process computes on the whole batch."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_rockopd.policies import RockOnlinePolicy, TokenBatch


VOCAB = 40
KWARGS = dict(top_k=3, min_count=2, exclude_top_frequent=1, warmup_steps=1, refresh_every=1, persistence=1, window=4)


def global_batches(steps=4):
    generator = torch.Generator().manual_seed(0)
    batches = []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (4, 12), generator=generator)
        mask = torch.rand(4, 12, generator=generator) > 0.2
        div = torch.rand(4, 12, generator=generator) * (1 + (ids % 7 == 0) * 5.0)
        batches.append((step, ids, mask, div))
    return batches


def run(policy, batches, rows):
    for step, ids, mask, div in batches:
        batch = TokenBatch(ids[rows], mask[rows], step, divergence=div[rows], scored=mask[rows])
        policy.update(batch, policy.weights(batch))
    policy.weights(TokenBatch(ids[rows], mask[rows], step + 1))  # roll over: commit the last step and refresh
    return policy


def worker(rank, world, port, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        policy = RockOnlinePolicy(**KWARGS)
        policy.setup(VOCAB)
        rows = slice(rank * 2, rank * 2 + 2)
        run(policy, global_batches(), rows)
        queue.put((rank, policy.rock_ids(), policy._totals.data.clone()))
    finally:
        dist.destroy_process_group()


def test_two_ranks_hold_the_single_process_statistics():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    processes = [ctx.Process(target=worker, args=(rank, 2, port, queue)) for rank in range(2)]
    for p in processes:
        p.start()
    results = dict((rank, (rocks, totals)) for rank, rocks, totals in (queue.get(timeout=120) for _ in processes))
    for p in processes:
        p.join(timeout=60)
        assert p.exitcode == 0

    single = RockOnlinePolicy(**KWARGS)
    single.setup(VOCAB)
    run(single, global_batches(), slice(0, 4))
    assert single.rock_ids(), "the crafted batches must produce rocks"
    for rank in (0, 1):
        rocks, totals = results[rank]
        assert rocks == single.rock_ids()
        torch.testing.assert_close(totals, single._totals.data)
