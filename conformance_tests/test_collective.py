"""Collective family: a real 2-process group built through the platform, plus the single-rank
collective a process gets when ``torch.distributed`` is not initialized.

The ranks are spawned once per module (torch.multiprocessing, spawn start method, so they start
as clean interpreters and see plugin platforms only through ``XHAL_PLUGINS``, as real TP workers
do). Each rank runs every collective in the same order, saves its results to a file, and the
parent compares them with what the rank-dependent integer inputs must produce.
"""

from __future__ import annotations

import contextlib
import math
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

WORLD_SIZE = 2
TIMEOUT_S = 300.0  # a hang fails the family instead of blocking it (generous: CI is loaded)
GRACE_S = 60.0  # once one rank has exited, how long the others get before they are killed


def rank_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # distinct small integers per element, offset by 100 per rank: a wrong rank order, dim or
    # chunk shows, and sums stay exact in every dtype (bfloat16 holds integers up to 256 exactly)
    return (torch.arange(math.prod(shape)).reshape(shape) % 50 + 1 + 100 * rank).to(dtype)


def _rank_main(rank: int, device_name: str, init_method: str, out_dir: str) -> None:
    """One rank: run every collective in a fixed order and save the results (or the error)."""
    results: dict[str, object] = {}
    try:
        import xhal

        platform = xhal.platforms.get(device_name)
        group = platform.init_process_group(rank, WORLD_SIZE, init_method)
        coll = platform.collective(group)
        device = platform.device(rank)
        results["rank"], results["world_size"] = coll.rank, coll.world_size
        for dtype in platform.capabilities.ops_dtypes:
            d = str(dtype)

            def x(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
                return rank_input(rank, shape, dtype).to(device)

            results[f"all_reduce/{d}"] = coll.all_reduce(x(3, 5))
            results[f"all_gather0/{d}"] = coll.all_gather(x(3, 5), dim=0)
            results[f"all_gather-1/{d}"] = coll.all_gather(x(3, 5), dim=-1)
            # a transposed (non-contiguous) input, as a sliced TP activation can be
            results[f"all_gather_t/{d}"] = coll.all_gather(x(5, 3).t(), dim=-1)
            results[f"reduce_scatter0/{d}"] = coll.reduce_scatter(x(4, 3), dim=0)
            results[f"broadcast0/{d}"] = coll.broadcast(x(2, 3), src=0)
            results[f"broadcast1/{d}"] = coll.broadcast(x(2, 3), src=1)
        # barrier: rank 1 arrives late; rank 0 must wait for it
        coll.barrier()
        if rank == 1:
            time.sleep(0.5)  # arrive late, so that a barrier that does not wait shows
        # time.monotonic is one system-wide clock on Linux, comparable across the ranks
        results["barrier_enter"] = time.monotonic()
        coll.barrier()
        results["barrier_exit"] = time.monotonic()
        platform.synchronize()
    except BaseException:  # noqa: BLE001  (the parent reports whatever went wrong in a rank)
        results["error"] = traceback.format_exc()
    results = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in results.items()}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    with contextlib.suppress(Exception):  # teardown problems must not hide the results above
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _run_ranks(device_name: str, tmp: Path) -> list[dict]:
    ctx = mp.get_context("spawn")
    init_method = f"file://{tmp / 'rendezvous'}"
    procs = [
        ctx.Process(target=_rank_main, args=(r, device_name, init_method, str(tmp)), daemon=True)
        for r in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        # ranks finish within moments of each other; once one is gone, the rest get only a grace
        if any(p.exitcode is not None for p in procs):
            deadline = min(deadline, time.monotonic() + GRACE_S)
        time.sleep(0.05)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    results, problems = [], []
    for r in range(WORLD_SIZE):
        path = tmp / f"rank{r}.pt"
        if not path.exists():  # a rank that raised explains a peer that then hung: report both
            state = "hung" if r in hung else f"exited with code {procs[r].exitcode}"
            problems.append(f"rank {r} {state} before reporting (timeout {TIMEOUT_S:.0f} s)")
            continue
        results.append(torch.load(path, weights_only=False))
        if "error" in results[-1]:
            problems.append(f"rank {r} raised:\n{results[-1]['error']}")
    if problems:
        pytest.fail("\n".join(problems))
    return results


def visible_devices(device_type: str) -> int | None:
    """How many devices of ``device_type`` this process sees, where torch can tell neutrally."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if device_type == "cpu" or accelerator is None or not accelerator.is_available():
        return None
    current = accelerator.current_accelerator()
    return accelerator.device_count() if current.type == device_type else None


@pytest.fixture(scope="module")
def ranks(platform, device_name: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    if not platform.capabilities.collective:
        pytest.skip(f"platform {device_name!r} declares capabilities.collective=False")
    count = visible_devices(platform.device_type)
    if count is not None and count < WORLD_SIZE:  # one device per rank, as NCCL / HCCL need
        pytest.skip(
            f"the 2-rank group needs {WORLD_SIZE} {platform.device_type} devices, {count} visible"
        )
    return _run_ranks(device_name, tmp_path_factory.mktemp("collective"))


def dtypes(platform) -> list[torch.dtype]:
    return list(platform.capabilities.ops_dtypes)


def check_all(ranks: list[dict], key: str, expected: list[torch.Tensor], record_error) -> None:
    """Rank r's result under ``key`` must equal ``expected[r]`` exactly."""
    for r, (res, want) in enumerate(zip(ranks, expected)):
        got = res[key]
        assert got.shape == want.shape, (
            f"{key} rank {r}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        )
        assert got.dtype == want.dtype, f"{key} rank {r}: dtype {got.dtype}, expected {want.dtype}"
        err = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
        record_error(err)
        assert err == 0, f"{key} rank {r}: got\n{got}\nexpected\n{want}"


def test_rank_and_world_size(ranks) -> None:
    assert [(res["rank"], res["world_size"]) for res in ranks] == [(0, 2), (1, 2)]


def test_all_reduce_sum(ranks, platform, record_error) -> None:
    for dtype in dtypes(platform):
        total = sum(rank_input(r, (3, 5), torch.float64) for r in range(WORLD_SIZE)).to(dtype)
        check_all(ranks, f"all_reduce/{dtype}", [total] * WORLD_SIZE, record_error)


@pytest.mark.parametrize("dim", [0, -1])
def test_all_gather(ranks, platform, dim, record_error) -> None:
    for dtype in dtypes(platform):
        parts = [rank_input(r, (3, 5), dtype) for r in range(WORLD_SIZE)]
        gathered = torch.cat(parts, dim=dim)  # rank order along dim
        check_all(ranks, f"all_gather{dim}/{dtype}", [gathered] * WORLD_SIZE, record_error)


def test_all_gather_non_contiguous(ranks, platform, record_error) -> None:
    for dtype in dtypes(platform):
        gathered = torch.cat([rank_input(r, (5, 3), dtype).t() for r in range(WORLD_SIZE)], dim=-1)
        check_all(ranks, f"all_gather_t/{dtype}", [gathered] * WORLD_SIZE, record_error)


def test_reduce_scatter(ranks, platform, record_error) -> None:
    for dtype in dtypes(platform):
        total = sum(rank_input(r, (4, 3), torch.float64) for r in range(WORLD_SIZE)).to(dtype)
        chunks = total.chunk(WORLD_SIZE, dim=0)  # rank r keeps rows [2r, 2r + 2)
        check_all(ranks, f"reduce_scatter0/{dtype}", list(chunks), record_error)


@pytest.mark.parametrize("src", [0, 1])
def test_broadcast(ranks, platform, src, record_error) -> None:
    for dtype in dtypes(platform):
        sent = rank_input(src, (2, 3), dtype)
        check_all(ranks, f"broadcast{src}/{dtype}", [sent] * WORLD_SIZE, record_error)


def test_barrier_waits_for_every_rank(ranks) -> None:
    # rank 1 arrives late; no rank may leave the barrier before the last one entered it (an
    # ordering of events, which holds however slowly a loaded machine runs either rank)
    last_in = max(r["barrier_enter"] for r in ranks)
    for rank, r in enumerate(ranks):
        assert r["barrier_exit"] >= last_in, (
            f"rank {rank} left the barrier {last_in - r['barrier_exit']:.3f} s before the last "
            "rank entered it"
        )


def test_single_rank_collective_is_identity(platform, device) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    coll = platform.collective(None)
    assert (coll.rank, coll.world_size) == (0, 1)
    x = rank_input(0, (4, 6), torch.float32).to(device)
    for name, out in [
        ("all_reduce", coll.all_reduce(x)),
        ("all_gather(dim=0)", coll.all_gather(x, dim=0)),
        ("all_gather(dim=-1)", coll.all_gather(x, dim=-1)),
        ("reduce_scatter(dim=0)", coll.reduce_scatter(x, dim=0)),
        ("broadcast(src=0)", coll.broadcast(x, src=0)),
    ]:
        assert torch.equal(out.cpu(), x.cpu()), f"single-rank {name} is not the identity"
    coll.barrier()
