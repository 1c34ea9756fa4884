"""The short table ``gpu_run.sh`` prints last: conformance per device and family, then the headline
figure of each benchmark that ran, read back from the reports and logs in the results folder.

    python3 scripts/gpu_summary.py RESULTS_DIR
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def read_table(text: str, title_start: str, spaced: bool = False) -> list[dict[str, str]]:
    """Rows of the first ``benchmarks.common.table`` whose title starts with ``title_start``.
    ``spaced``: its headers and cells hold single spaces, so columns are two or more spaces
    apart."""

    def split(line: str) -> list[str]:
        return re.split(r"\s{2,}", line.strip()) if spaced else line.split()

    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(title_start) and i + 1 < len(lines):
            header = split(lines[i + 1])
            rows = []
            for row in lines[i + 2 :]:
                cells = split(row)
                if len(cells) != len(header):
                    break
                rows.append(dict(zip(header, cells)))
            return rows
    return []


def conformance(out: Path) -> list[str]:
    lines = []
    for report in sorted(out.glob("conformance-*.json")):
        data = json.loads(report.read_text())
        # named by the file (conformance-<label>.json): runs of one device under other settings
        # (gpu_run.sh tp's cuda-nccl and cuda-one-shot) stay apart
        data["device"] = report.stem.removeprefix("conformance-")
        families = data.get("families", data)
        for name, r in sorted(families.items()):
            if isinstance(r, dict) and "passed" in r:
                lines.append(
                    f"conformance {data.get('device', report.stem):<12} {name:<11} "
                    f"{r['passed']:>4} passed {r['failed']:>3} failed {r['skipped']:>3} skipped"
                )
        by_status: dict[str, list[str]] = {}
        for key, sol in data.get("solutions", {}).items():  # every registered kernel solution
            by_status.setdefault(sol["status"], []).append(key)
        for status, keys in sorted(by_status.items()):
            lines.append(
                f"solutions   {data.get('device', report.stem):<12} {status:<13} {len(keys):>3}: "
                f"{', '.join(keys)}"
            )
    return lines


def benchmarks(out: Path) -> list[str]:
    lines = []
    model = out / "bench_model.txt"
    if model.exists():
        named = re.search(r"decode step \(execute \+ logits\), (\S+) shape", model.read_text())
        shape = named.group(1) if named else "model"
        for r in read_table(model.read_text(), "decode step"):
            honest = (
                f" ({r['pipelined_x_read_floor']}x read floor)"
                if "pipelined_x_read_floor" in r
                else ""
            )
            lines.append(
                f"decode {shape} batch {r['batch']:>3}: "
                f"pipelined {r.get('pipelined_ms', '?')} ms = "
                f"{r.get('pipelined_x_floor', '?')}x floor{honest}, graph/eager "
                f"{r.get('graph_speedup', '?')}x, "
                f"host {r.get('host_us', '?')} us"
            )
        for r in read_table(model.read_text(), "peer:"):
            speedups = {k: v for k, v in r.items() if k.startswith("xhal_graph_speedup")}
            lines.append(
                f"transformers batch {r['batch']:>3}: xhal faster by "
                + ", ".join(
                    f"{v}x ({k.removeprefix('xhal_graph_speedup_vs_')})"
                    for k, v in speedups.items()
                )
            )
    for name in ("skinny.txt", "bench_skinny_mma.txt", "skinny-wgmma.txt"):
        path = out / name
        if path.exists():
            for r in read_table(path.read_text(), "best launch shape against cuBLAS", spaced=True):
                lines.append(
                    f"skinny GEMM {r['projection']} x {r['rows']} rows: cuBLAS {r['cuBLAS us']} us"
                    f" ({r['cuBLAS of read']} of read), {r['best']} {r['best us']} us"
                    f" ({r['best of read']}), cuBLAS / best {r['cuBLAS / best']}"
                )
    attention = out / "bench_attention.txt"
    if attention.exists():
        for r in read_table(attention.read_text(), "decode attention"):
            if r["batch"] == "64" and r["ctx"] == "2048":
                lines.append(
                    f"decode attention {r['path']} 64 x 2K: {r['us']} us, {r['of_copy_ceiling']} "
                    f"of copy ceiling"
                )
    tp = out / "bench_tp.txt"
    if tp.exists():  # benchmarks/bench_tp.py (gpu_run.sh tp)
        for r in read_table(tp.read_text(), "decode step,", spaced=True):
            floor = f" = {r['x_read_floor']}x read floor" if "x_read_floor" in r else ""
            with_it = r.get("one_shot_step_ms", "-")
            lines.append(
                f"TP={r['tp']} batch {r['batch']:>3}: step {r['step_ms']} ms{floor}, all-reduces "
                f"{r['allreduce_ms']} ms ({r['allreduce_share']} of it), one-shot alone "
                f"{r['one_shot_ms']}, step with it {with_it}; logits vs the first TP size "
                f"{r['logits_rel_diff']}, argmax {r['argmax_equal']}"
            )
    ids = out / "tp_served_ids.txt"
    if ids.exists() and ids.read_text().strip():  # benchmarks/served_ids.py compare
        lines.append("xhal-serve " + ids.read_text().splitlines()[0])
    serve = out / "serve_bench.txt"
    if serve.exists():
        text = serve.read_text()
        # gpu_run.sh heads each run "=== serve SHAPE concurrency C"; older files have two bare runs
        sections = re.split(r"^=== serve (\S+) concurrency (\d+)\n", text, flags=re.MULTILINE)
        if len(sections) > 1:
            runs = [
                (f"{shape} ", int(c), body) for shape, c, body in zip(*[iter(sections[1:])] * 3)
            ]
        else:  # one run per "P50 TTFT" (each run prints TTFT before TPOT)
            runs = [("", c, body) for c, body in zip((1, 64), re.split(r"(?=P50 TTFT)", text)[1:])]
        for shape, c, body in runs:
            tpot = re.search(r"Mean TPOT \(ms\)\s+([\d.]+)", body)
            ttft = re.search(r"P50 TTFT \(ms\)\s+([\d.]+)", body)
            itl = re.search(r"P50 ITL \(ms\)\s+([\d.]+)", body)
            if tpot and ttft:
                extra = f", ITL p50 {itl.group(1)} ms" if itl else ""
                if itl and c == 1:
                    extra += served_rate(shape.strip(), float(itl.group(1)), sections[0])
                lines.append(
                    f"xhal-serve {shape}concurrency {c:>2}: TPOT {tpot.group(1)} ms, "
                    f"TTFT p50 {ttft.group(1)} ms{extra}"
                )
    return lines


def served_rate(shape: str, itl_ms: float, head: str) -> str:
    """`` = G GB/token at R TB/s, P% of the read ceiling`` for a batch-1 inter-token latency of a
    Llama shape the benchmarks know, when ``head`` (what the serve stage printed before its
    runs) gives the read ceiling and the lengths; the bytes are a decode step's at the run's
    mean context (the prompt and half the output). Empty otherwise."""
    ceiling = re.search(r"^=== read ceiling ([\d.]+) TB/s", head, flags=re.MULTILINE)
    lengths = re.search(r"^=== serve lengths (\d+) (\d+)", head, flags=re.MULTILINE)
    try:
        from benchmarks.llama_model import SHAPES, decode_read_bytes, shape_weight_bytes
    except ImportError:  # run from elsewhere than the repository root
        return ""
    config = SHAPES.get(shape)
    if config is None or ceiling is None or lengths is None:
        return ""
    ctx = int(lengths.group(1)) + int(lengths.group(2)) // 2
    step = decode_read_bytes(config, shape_weight_bytes(config), 1, ctx)["honest"]
    rate = step / (itl_ms * 1e-3)
    share = rate / (float(ceiling.group(1)) * 1e12)
    gb, tbs = step / 1e9, rate / 1e12
    return f" = {gb:.2f} GB/token at {tbs:.2f} TB/s, {share:.0%} of the read ceiling"


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/xhal-gpu")
    lines = conformance(out) + benchmarks(out)
    print("=== summary")
    print("\n".join(lines) if lines else f"no results in {out}")


if __name__ == "__main__":
    main()
