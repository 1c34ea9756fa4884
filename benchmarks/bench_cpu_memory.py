"""Memory of ``xhal-serve --device cpu`` over prompts of growing length: the resident set (API and
engine processes together) right after start, after each prompt, and its peak, as a table.

    python -m benchmarks.bench_cpu_memory                      # the default model (SmolLM2)
    python -m benchmarks.bench_cpu_memory --server-arg=--no-enforce-eager   # CPU graphs, to compare

The peak is both polled (every 20 ms) and read from the kernel's high-water marks (``VmHWM``,
reset after start through ``/proc/PID/clear_refs``), summed over the processes: an upper bound
that no short spike between two polls escapes. Linux only (``/proc``).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import click

from tests.support.launcher import ServerProcess

MIB = 1 << 20
LIMIT = 1.5  # the peak may be at most this multiple of the after-start figure


def process_tree(pid: int) -> list[int]:
    """``pid`` and every descendant alive now."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass  # gone meanwhile
    return tree


def status_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_bytes(pid: int, field: str = "VmRSS") -> int:
    return 1024 * sum(status_kib(p, field) for p in process_tree(pid))


def reset_peaks(pid: int) -> None:
    for p in process_tree(pid):
        Path(f"/proc/{p}/clear_refs").write_text("5")  # 5: reset VmHWM to the current RSS


class PeakSampler(threading.Thread):
    def __init__(self, pid: int, period_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pid, self.period_s, self.peak = pid, period_s, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period_s):
            self.peak = max(self.peak, tree_bytes(self.pid))


def token_prompt(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default=None, help="Model to serve [default: the built-in default].")
@click.option(
    "--lengths",
    default="10,100,300,655,1000,1309,1500",
    show_default=True,
    help="Prompt lengths in tokens, sent in this order, one request at a time.",
)
@click.option("--max-tokens", default=8, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--vocab", default=500, show_default=True, help="Prompt token ids are drawn from [3, VOCAB)."
)
@click.option("--server-arg", multiple=True, help="Passed on to xhal-serve (repeatable).")
@click.option("--start-timeout", default=900.0, show_default=True, help="Seconds to wait for it.")
def main(
    model: str | None,
    lengths: str,
    max_tokens: int,
    vocab: int,
    server_arg: tuple[str, ...],
    start_timeout: float,
) -> None:
    import httpx

    args = ["--device", "cpu", "--log-level", "warning", *server_arg]
    args += ["--model", model] if model else []
    with ServerProcess(args, timeout=start_timeout) as server:
        pid = server.process.pid
        after_start = tree_bytes(pid)
        reset_peaks(pid)
        sampler = PeakSampler(pid)
        sampler.start()
        name = httpx.get(f"{server.url}/v1/models", timeout=60).json()["data"][0]["id"]
        print(f"xhal-serve {' '.join(args)}: {after_start / MIB:.0f} MiB after start")
        print(f"{'prompt tokens':>13} {'seconds':>8} {'RSS after, MiB':>15} {'peak so far':>12}")
        for i, length in enumerate(int(n) for n in lengths.split(",")):
            body = {
                "model": name,
                "prompt": token_prompt(length, i, vocab),
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            start = time.monotonic()
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=1800)
            response.raise_for_status()
            seconds = time.monotonic() - start
            now = tree_bytes(pid)
            peak = max(sampler.peak, now)
            print(f"{length:>13} {seconds:>8.1f} {now / MIB:>15.0f} {peak / MIB:>12.0f}")
        sampler.done.set()
        sampler.join()
        polled = max(sampler.peak, tree_bytes(pid))
        high_water = tree_bytes(pid, "VmHWM")
    peak = max(polled, high_water)
    ratio = peak / after_start
    print(
        f"after start {after_start / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB (polled "
        f"{polled / MIB:.0f}, high-water {high_water / MIB:.0f}): {ratio:.2f}x "
        f"({'within' if ratio <= LIMIT else 'OVER'} {LIMIT}x)"
    )


if __name__ == "__main__":
    main()
