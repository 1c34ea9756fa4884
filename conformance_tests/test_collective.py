"""Collective family: a real 2-process group built through the platform (with one collective
replayed from a captured graph where graphs are declared), sub-groups of a 4-process world (ranks
{0, 2} and {1, 3}, where a group rank is not the global rank), plus the single-rank collective a
process gets when ``torch.distributed`` is not initialized.

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

from conformance_tests.coverage import cannot_exercise

WORLD_SIZE = 2
SUBGROUP_WORLD = 4
SUBGROUPS = ([0, 2], [1, 3])  # group rank g of a sub-group is global rank SUBGROUPS[i][g]
TIMEOUT_S = 300.0  # a hang fails the family instead of blocking it (generous: CI is loaded)
GRACE_S = 60.0  # once one rank has exited, how long the others get before they are killed


def rank_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # distinct small integers per element, offset by 100 per rank: a wrong rank order, dim or
    # chunk shows, and sums stay exact in every dtype (bfloat16 holds integers up to 256 exactly)
    return (torch.arange(math.prod(shape)).reshape(shape) % 50 + 1 + 100 * rank).to(dtype)


def subgroup_input(rank: int, dtype: torch.dtype) -> torch.Tensor:
    # [4, 3], 30 apart per rank: a pair's sums stay below 256, exact in bfloat16
    return (torch.arange(12).reshape(4, 3) % 20 + 1 + 30 * rank).to(dtype)


def _world_program(platform, rank: int, group, results: dict) -> None:
    """The 2-rank world: every collective in a fixed order."""
    coll = platform.collective(group)
    device = platform.device(rank)
    results["rank"], results["world_size"] = coll.rank, coll.world_size
    if True:
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
        if platform.capabilities.graphs:
            # a collective captured in a graph (TP decode graphs all-reduce inside the graph):
            # replay reduces what the input holds at replay time
            dtype = platform.capabilities.ops_dtypes[0]
            staged = rank_input(rank, (3, 5), dtype).to(device)
            runner = platform.graph_runner()
            runner.capture("all_reduce", lambda: coll.all_reduce(staged))
            staged.copy_(rank_input(rank, (3, 5), dtype).flip(0).to(device))
            results["graph_all_reduce"] = runner.replay("all_reduce").clone()
        # barrier: rank 1 arrives late; rank 0 must wait for it
        coll.barrier()
        if rank == 1:
            time.sleep(0.5)  # arrive late, so that a barrier that does not wait shows
        # time.monotonic is one system-wide clock on Linux, comparable across the ranks
        results["barrier_enter"] = time.monotonic()
        coll.barrier()
        results["barrier_exit"] = time.monotonic()


def _subgroup_program(platform, rank: int, world, results: dict) -> None:
    """The 4-rank world split into two groups; each rank works on its own group only."""
    import torch.distributed as dist

    groups = [dist.new_group(members) for members in SUBGROUPS]  # every rank creates every group
    mine = next(i for i, members in enumerate(SUBGROUPS) if rank in members)
    coll = platform.collective(groups[mine])
    device = platform.device(rank)
    results["rank"], results["world_size"] = coll.rank, coll.world_size
    for dtype in platform.capabilities.ops_dtypes:
        d, x = str(dtype), subgroup_input(rank, dtype).to(device)
        results[f"all_reduce/{d}"] = coll.all_reduce(x)
        results[f"all_gather0/{d}"] = coll.all_gather(x, dim=0)
        results[f"reduce_scatter0/{d}"] = coll.reduce_scatter(x, dim=0)
        results[f"broadcast1/{d}"] = coll.broadcast(x, src=1)  # group rank 1
    coll.barrier()


PROGRAMS = {"world": _world_program, "subgroups": _subgroup_program}


def _rank_main(
    rank: int, world_size: int, program: str, device_name: str, init_method: str, out_dir: str
) -> None:
    """One rank: run ``program`` and save the results (or the error)."""
    results: dict[str, object] = {}
    try:
        import xhal

        platform = xhal.platforms.get(device_name)
        group = platform.init_process_group(rank, world_size, init_method)
        PROGRAMS[program](platform, rank, group, results)
        platform.synchronize()
    except BaseException:  # noqa: BLE001  (the parent reports whatever went wrong in a rank)
        results["error"] = traceback.format_exc()
    results = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in results.items()}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    with contextlib.suppress(Exception):  # teardown problems must not hide the results above
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _run_ranks(
    device_name: str, tmp: Path, world_size: int = WORLD_SIZE, program: str = "world"
) -> list[dict]:
    ctx = mp.get_context("spawn")
    init_method = f"file://{tmp / 'rendezvous'}"
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world_size, program, device_name, init_method, str(tmp)),
            daemon=True,
        )
        for r in range(world_size)
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
    for r in range(world_size):
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


def _spawn(platform, device_name, tmp_path_factory, world_size, program) -> list[dict] | str:
    """The ranks' results, or why this machine cannot run them."""
    if not platform.capabilities.collective:
        pytest.skip(f"platform {device_name!r} declares capabilities.collective=False")
    count = visible_devices(platform.device_type)
    if count is not None and count < world_size:  # one device per rank, as NCCL / HCCL need
        return (
            f"{world_size} ranks need {world_size} {platform.device_type} devices, {count} visible"
        )
    return _run_ranks(device_name, tmp_path_factory.mktemp(program), world_size, program)


@pytest.fixture(scope="module")
def _world_run(platform, device_name: str, tmp_path_factory) -> list[dict] | str:
    return _spawn(platform, device_name, tmp_path_factory, WORLD_SIZE, "world")


@pytest.fixture(scope="module")
def _subgroup_run(platform, device_name: str, tmp_path_factory) -> list[dict] | str:
    return _spawn(platform, device_name, tmp_path_factory, SUBGROUP_WORLD, "subgroups")


@pytest.fixture
def ranks(request, _world_run) -> list[dict]:
    if isinstance(_world_run, str):
        cannot_exercise(request, "collective world group", _world_run)
    return _world_run


@pytest.fixture
def subgroup_ranks(request, _subgroup_run) -> list[dict]:
    if isinstance(_subgroup_run, str):
        cannot_exercise(request, "collective sub-groups", _subgroup_run)
    return _subgroup_run


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


def test_all_reduce_sum(ranks, platform, record_error, record_coverage) -> None:
    for dtype in dtypes(platform):
        total = sum(rank_input(r, (3, 5), torch.float64) for r in range(WORLD_SIZE)).to(dtype)
        check_all(ranks, f"all_reduce/{dtype}", [total] * WORLD_SIZE, record_error)
    record_coverage("collective world group")


def test_all_reduce_replayed_from_a_graph(ranks, platform, record_error) -> None:
    if not platform.capabilities.graphs:
        pytest.skip(f"{platform.name} declares no graphs")
    dtype = platform.capabilities.ops_dtypes[0]
    total = sum(rank_input(r, (3, 5), torch.float64).flip(0) for r in range(WORLD_SIZE))
    check_all(ranks, "graph_all_reduce", [total.to(dtype)] * WORLD_SIZE, record_error)


def test_subgroups(subgroup_ranks, platform, record_error, record_coverage) -> None:
    """Every collective over groups {0, 2} and {1, 3} of a 4-rank world: results over the
    group's members only, in group-rank order, and ``broadcast(src)`` takes a group rank."""
    members_of = {r: next(m for m in SUBGROUPS if r in m) for r in range(SUBGROUP_WORLD)}
    ranks_seen = [(res["rank"], res["world_size"]) for res in subgroup_ranks]
    assert ranks_seen == [(members_of[r].index(r), 2) for r in range(SUBGROUP_WORLD)], (
        f"(rank, world_size) per global rank {ranks_seen}: expected the group's rank and size"
    )
    for dtype in dtypes(platform):
        x = {r: subgroup_input(r, torch.float64) for r in range(SUBGROUP_WORLD)}
        expected = {
            "all_reduce": lambda m, g, x=x: sum(x[r] for r in m),
            "all_gather0": lambda m, g, x=x: torch.cat([x[r] for r in m], dim=0),
            "reduce_scatter0": lambda m, g, x=x: sum(x[r] for r in m).chunk(2, dim=0)[g],
            "broadcast1": lambda m, g, x=x: x[m[1]],  # group rank 1, not global rank 1
        }
        for name, want in expected.items():
            per_rank = [
                want(members_of[r], members_of[r].index(r)).to(dtype) for r in range(SUBGROUP_WORLD)
            ]
            check_all(subgroup_ranks, f"{name}/{dtype}", per_rank, record_error)
    record_coverage("collective sub-groups")


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
