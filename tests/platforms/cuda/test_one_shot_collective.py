"""OneShotCollective's routing, on two CPU ranks over gloo with the symmetric-memory calls
replaced by gloo equivalents (the real ones need two GPUs: issue 14's run): small all-reduces of
a float dtype go through one buffer per dtype, made once and only eagerly; larger tensors,
other dtypes and a capture before the buffer exists take NCCL's path (here gloo's)."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, init: str, out: str) -> None:
    from xhal.platforms.cuda import collective as module

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    made, shots, capturing = [], [], [False]

    def symmetric_buffer(numel, like, group_name):
        made.append((numel, like.dtype))
        return torch.zeros(numel, dtype=like.dtype)

    def one_shot_all_reduce(staged, group_name, out):
        total = staged.clone()
        dist.all_reduce(total)
        out.copy_(total)
        shots.append(staged.shape)

    module.symmetric_buffer = symmetric_buffer
    module.one_shot_all_reduce = one_shot_all_reduce
    torch.cuda.is_current_stream_capturing = lambda: capturing[0]
    coll = module.OneShotCollective(dist.group.WORLD)
    coll.MAX_BYTES = 256
    results = {}

    def reduce(name, x):
        results[name] = (coll.all_reduce(x), len(made), len(shots))

    base = torch.arange(16.0).view(2, 8) + rank
    reduce("bf16", base.bfloat16())
    reduce("bf16 again", (base * 2).bfloat16())
    reduce("fp32", base.clone())
    reduce("too large", torch.ones(2, 64) * (rank + 1))  # 512 bytes of fp32
    reduce("int64", base.long())
    capturing[0] = True
    reduce("fp16 under capture", base.half())
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    os._exit(0)


def test_one_shot_routing_on_two_ranks() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank, args=(f"file://{tmp}/rendezvous", tmp), nprocs=2, start_method="spawn"
        )
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    base = torch.arange(16.0).view(2, 8)
    want = {
        # name: (sum over the ranks, buffers made by then, one-shot calls by then)
        "bf16": (2 * base + 1, 1, 1),
        "bf16 again": (4 * base + 2, 1, 2),  # the same buffer
        "fp32": (2 * base + 1, 2, 3),  # a buffer of its own dtype
        "too large": (torch.full((2, 64), 3.0), 2, 3),  # over MAX_BYTES: NCCL's path
        "int64": (2 * base + 1, 2, 3),  # not a float dtype: NCCL's path
        "fp16 under capture": (2 * base + 1, 2, 3),  # no buffer yet, and none made in a capture
    }
    for r in results:
        for name, (total, made, shots) in want.items():
            got, got_made, got_shots = r[name]
            torch.testing.assert_close(got.double(), total.double(), msg=name)
            assert (got_made, got_shots) == (made, shots), name
