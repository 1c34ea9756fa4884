"""Tensor parallelism on one host (issue 14): the decode step at each TP size, against its read
floor with the bandwidth of all its devices, and the all-reduces the step makes, on the
executor's collective (NCCL on CUDA) and, as the peer, the one-shot all-reduce of torch's
symmetric memory (each rank reads every peer's buffer over NVLink peer memory; no multicast).

    python -m benchmarks.bench_tp --device cuda --shape llama3-8b --batches 1 64 --tp 1 2
    python -m benchmarks.bench_tp --device cpu --shape tiny --batches 1 2 --tp 1 2 --ctx 64

Each TP size runs in processes of its own, one per rank (rank r on device r), each building its
shards of the same model: dummy weights are the same model at every TP size
(``models.loader``), and the KV caches are filled from one seeded draw per layer, each rank
keeping its KV heads. So rank 0's logits at every TP size are compared with the first size's.

Per batch (ctx tokens of context each): the step (``execute`` + ``compute_logits``; the decode
graph replayed back to back on CUDA, eager on the CPU); its read floor, the bytes one rank reads
(its weight shards, one embedding row a sequence where the table is not the LM head, its share
of the KV) over that rank's read ceiling, the slowest rank's; and the step's all-reduces alone:
two a layer of ``[batch, hidden]`` (after o and after down), captured in one graph like the
step. On CUDA with 2+ ranks the step runs a second time, through the one-shot collective
(``OneShotCollective``: the same model, caches and inputs; its logits against NCCL's). NVLink
multicast stays off (``NCCL_NVLS_ENABLE=0``; the one-shot peer uses none).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from benchmarks.common import table
from benchmarks.llama_model import BLOCK, SHAPES, decode_metadata, decode_read_bytes

SHAPES_TP = {
    **SHAPES,
    # a few-MB Llama for the CPU (the tests run it): 4 heads over 2 KV heads, so TP=2 splits both
    "tiny": {
        **SHAPES["llama3-8b"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
    },
}
STEPS = 20  # steps a timing issues back to back
REPS = 5  # timings; the median is reported


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES_TP))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes, in order")
    parser.add_argument("--ctx", type=int, default=2048, help="context tokens a sequence")
    parser.add_argument(
        "--no-one-shot-step",
        dest="one_shot_step",
        action="store_false",
        help="CUDA, 2+ ranks: skip the step with the one-shot all-reduce (OneShotCollective)",
    )
    args = parser.parse_args()
    if args.device == "cuda":
        visible = torch.cuda.device_count()
        if max(args.tp) > visible:
            raise SystemExit(f"--tp {max(args.tp)} needs {max(args.tp)} GPUs; {visible} visible")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (the device docs)
    if args.ctx % BLOCK:
        raise SystemExit(f"--ctx must be a multiple of the block size {BLOCK}")
    rows: list[dict] = []
    first: dict[int, torch.Tensor] = {}  # batch -> rank 0's logits at the first TP size
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(SHAPES_TP[args.shape]))
        for tp in args.tp:
            out = Path(tmp) / f"tp{tp}"
            out.mkdir()
            spawn = dict(nprocs=tp, start_method="spawn", join=True)
            mp.start_processes(_rank, args=(tp, vars(args), str(model_dir), str(out)), **spawn)
            ranks = [torch.load(out / f"rank{r}.pt") for r in range(tp)]
            rows += _rows(tp, ranks, first)
    columns = list(dict.fromkeys(c for row in rows for c in row))  # TP>1 rows have more
    print(
        table(
            [{c: row.get(c, "-") for c in columns} for row in rows],
            f"decode step, {args.shape} shape, ctx {args.ctx}, {args.device}; read floor = the "
            "bytes one rank reads over its read ceiling (slowest rank); all-reduces = the step's "
            "2 a layer alone, in one graph; logits vs the first TP size, rank 0, relative",
        )
    )


def _rows(tp: int, ranks: list[dict], first: dict[int, torch.Tensor]) -> list[dict]:
    """One row per batch from the ranks' results. ``first`` holds rank 0's logits per batch of
    the first TP size run (filled by that call), which later sizes are compared with."""
    rows = []
    for i, result in enumerate(ranks[0]["batches"]):
        batch = result["batch"]
        per_rank = [rank["batches"][i] for rank in ranks]
        step_ms = max(r["step_ms"] for r in per_rank)
        row = {"tp": tp, "batch": batch, "step_ms": step_ms}
        floors = [r["read_floor_ms"] for r in per_rank if r["read_floor_ms"] is not None]
        if floors:
            row["read_floor_ms"] = max(floors)
            row["x_read_floor"] = step_ms / row["read_floor_ms"]
        row["allreduce_ms"] = max(r["allreduce_ms"] for r in per_rank)
        row["allreduce_share"] = row["allreduce_ms"] / step_ms
        one_shot = [r["one_shot_ms"] for r in per_rank]
        row["one_shot_ms"] = max(one_shot) if None not in one_shot else result["one_shot_note"]
        if "one_shot_step_ms" in result:  # the step with the one-shot collective, its logits
            row["one_shot_step_ms"] = max(r["one_shot_step_ms"] for r in per_rank)
            row["one_shot_logits_diff"] = result["one_shot_logits_diff"]
        logits = result["logits"]
        ref = first.setdefault(batch, logits)
        row["logits_rel_diff"] = float((logits - ref).abs().max() / ref.abs().max())
        row["argmax_equal"] = f"{int((logits.argmax(-1) == ref.argmax(-1)).sum())}/{batch}"
        rows.append(row)
    return rows


def _rank(rank: int, world: int, args: dict, model_dir: str, out: str) -> None:
    import xhal
    from models.loader import load_model
    from xhal.executor import ExecutorConfig, ModelExecutor
    from xhal.layers import TensorParallel

    platform = xhal.platforms.get(args["device"])
    cuda = args["device"] == "cuda"
    init = f"file://{out}/rendezvous"
    group = platform.init_process_group(rank, world, init) if world > 1 else None
    if cuda and world == 1:
        platform.set_device(0)
    device = platform.device()
    config = SHAPES_TP[args["shape"]]
    batches, ctx = args["batches"], args["ctx"]
    dtype = torch.bfloat16 if cuda else torch.float32
    model = load_model(
        model_dir, dtype, device, TensorParallel(rank, world), progress=False, load_format="dummy"
    )
    collective = platform.collective(group)
    executor = ModelExecutor(
        model,
        platform,
        ExecutorConfig(
            dtype=dtype,
            block_size=BLOCK,
            max_num_seqs=max(batches),
            max_model_len=ctx + 64,
            enforce_eager=not cuda,
            decode_graph_sizes=tuple(batches),
        ),
        collective,
    )
    caches = executor.allocate_kv_caches(num_blocks=max(batches) * ctx // BLOCK + 64)
    _fill_caches(caches, config, rank, world)
    executor.bind_kv_caches(caches)
    peer = None  # the same model and caches, all-reducing through the one-shot collective
    if cuda and world > 1 and args["one_shot_step"]:
        from xhal.platforms.cuda.collective import OneShotCollective

        peer = ModelExecutor(model, platform, executor.config, OneShotCollective(group))
        peer.bind_kv_caches(caches)
    if cuda:
        for ex in filter(None, (executor, peer)):
            ex.capture_graphs(progress=False)
        from benchmarks.common import read_bandwidth

        read = read_bandwidth()["read"]
    else:
        read = None
    results = []
    for batch in batches:
        torch.manual_seed(batch)  # the same token ids at every TP size
        ids, pos, meta = decode_metadata(batch, ctx, device, config["vocab_size"])

        def step(ids=ids, pos=pos, meta=meta):
            return executor.compute_logits(executor.execute(ids, pos, meta))

        logits = step().float().cpu()
        nbytes = _rank_read_bytes(model, config, batch, ctx, world, dtype)
        ar_ms, (one_shot_ms, note) = _allreduces(collective, group, config, batch, dtype, device)
        result = {
            "batch": batch, "logits": logits, "step_ms": _time(step, cuda),
            "read_floor_ms": nbytes / read * 1e3 if read else None,
            "allreduce_ms": ar_ms, "one_shot_ms": one_shot_ms, "one_shot_note": note,
        }  # fmt: skip
        if peer is not None:

            def peer_step(ids=ids, pos=pos, meta=meta):
                return peer.compute_logits(peer.execute(ids, pos, meta))

            theirs = peer_step().float().cpu()
            result["one_shot_step_ms"] = _time(peer_step, cuda)
            result["one_shot_logits_diff"] = float(
                (theirs - logits).abs().max() / logits.abs().max()
            )
        results.append(result)
    torch.save({"batches": results}, os.path.join(out, f"rank{rank}.pt"))
    if group is not None:
        torch.distributed.barrier()  # every rank is past its last collective
    os._exit(0)  # no process-group teardown: under load gloo's has aborted after the results


def _fill_caches(caches, config: dict, rank: int, world: int) -> None:
    """Every layer's K and V from one seeded draw of all KV heads (the TP=1 caches), this rank
    keeping its heads: so every TP size attends over the same context."""
    heads = config["num_key_value_heads"]
    mine = slice(rank * heads // world, (rank + 1) * heads // world)
    gen = torch.Generator(device=caches[0].key.device).manual_seed(1)
    for cache in caches:
        for t in (cache.key, cache.value):
            whole = torch.empty(*t.shape[:2], heads, t.shape[3], dtype=t.dtype, device=t.device)
            t.copy_(whole.normal_(0.0, 1.0, generator=gen)[:, :, mine])


def _rank_read_bytes(model, config: dict, batch: int, ctx: int, world: int, dtype) -> int:
    """Bytes one rank's decode step reads (``decode_read_bytes``' honest count for its shards):
    its weight shards (of an embedding that is not the LM head, one row a sequence) and its
    share of the KV of ``ctx`` tokens a sequence."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    shard = {
        **config,
        "num_key_value_heads": config["num_key_value_heads"] // world,
        "vocab_size": model.model.embed_tokens.weight.shape[0],  # the rank's table rows
    }
    return decode_read_bytes(shard, weights, batch, ctx, torch.finfo(dtype).bits // 8)["honest"]


def _allreduces(collective, group, config: dict, batch: int, dtype, device):
    """ms of the step's all-reduces alone (2 a layer of ``[batch, hidden]``) on ``collective``,
    and ``(ms, "")`` of the same on ``OneShotCollective`` (symmetric memory's one-shot
    all-reduce; CUDA, 2+ ranks) or ``(None, why not)``."""
    calls = 2 * config["num_hidden_layers"]
    x = torch.randn(batch, config["hidden_size"], dtype=dtype, device=device)
    if group is None:  # one rank's all-reduce returns its input: nothing to launch or time
        return 0.0, (None, "one rank")
    if device.type != "cuda":
        return _time(lambda: [collective.all_reduce(x.clone()) for _ in range(calls)], False), (
            None, "CUDA only"
        )
    from benchmarks.common import capture_graph

    nccl = _time(capture_graph(lambda: [collective.all_reduce(x) for _ in range(calls)]).replay)
    from xhal.platforms.cuda.collective import OneShotCollective

    try:
        one_shot = OneShotCollective(group)
        if one_shot.unavailable is not None:
            return nccl, (None, one_shot.unavailable)
        want, got = collective.all_reduce(x), one_shot.all_reduce(x)  # eager: makes its buffer
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        if err > 1e-2:
            return nccl, (None, f"one-shot result off by {err:.2e}")
        ms = _time(capture_graph(lambda: [one_shot.all_reduce(x) for _ in range(calls)]).replay)
        return nccl, (ms, "")
    except Exception as e:  # what this torch build or machine lacks: reported, not fatal
        return nccl, (None, f"{type(e).__name__}: {str(e)[:80]}")


def _time(fn, cuda: bool = True) -> float:
    """Median ms per call of ``fn`` issued ``STEPS`` times back to back (CUDA events; on the
    CPU the host clock)."""
    if cuda:
        from benchmarks.common import time_cuda_pipelined

        return time_cuda_pipelined(fn, steps=STEPS, reps=REPS)
    fn()
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        for _ in range(STEPS):
            fn()
        times.append((time.perf_counter() - start) * 1e3 / STEPS)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
