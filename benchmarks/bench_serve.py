"""Serving benchmark: a synthetic workload against any OpenAI-compatible server, like
``vllm bench serve``.

Fires ``--num-prompts`` streaming ``/v1/completions`` requests of about ``--input-len`` prompt
tokens and exactly ``--output-len`` output tokens (``ignore_eos``), arriving as a Poisson process
of ``--request-rate`` requests/s (``inf``: all at once), at most ``--max-concurrency`` in flight,
and prints TTFT, TPOT and ITL (mean, p50, p99), end-to-end latency, request throughput and
token throughput. Token counts come from the server's ``usage``.

    xhal-serve &                      # or any OpenAI-compatible server
    xhal-bench-serve --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 8
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import click

WORDS = (
    "the quick brown fox jumps over a lazy dog while small models run on any device "
    "through one layer of abstraction and numbers count one two three four five six"
).split()


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def make_prompts(num: int, input_len: int, token_ids: bool, vocab: int, seed: int) -> list:
    rng = random.Random(seed)
    if token_ids:
        return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(num)]
    return [" ".join(rng.choice(WORDS) for _ in range(input_len)) for _ in range(num)]


async def one_request(client, url: str, payload: dict, headers: dict) -> Result:
    result, start = Result(), time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                now = time.perf_counter()
                # a token arrived: text, or its ids (random-weight models emit ids the tokenizer
                # decodes to nothing)
                if any(c.get("text") or c.get("token_ids") for c in chunk.get("choices", [])):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.latency = time.perf_counter() - start
        result.ok = True
    except Exception as e:  # a failed request is counted, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_workload(
    base_url: str,
    model: str,
    prompts: list,
    output_len: int,
    request_rate: float,
    max_concurrency: int | None,
    api_key: str | None,
    seed: int,
    progress: bool,
) -> tuple[list[Result], float]:
    import httpx
    from tqdm import tqdm

    url = f"{base_url.rstrip('/')}/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    rng = random.Random(seed)
    bar = tqdm(total=len(prompts), disable=not progress, desc="requests")

    async def fire(client, prompt) -> Result:
        payload = {
            "model": model,
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        async with limit:
            result = await one_request(client, url, payload, headers)
        bar.update(1)
        return result

    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts) or 1)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start, tasks = time.perf_counter(), []
        for prompt in prompts:
            tasks.append(asyncio.create_task(fire(client, prompt)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(results: list[Result], duration: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [gap for r in ok for gap in r.itl]
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": output / duration if duration else 0.0,
        "total_token_throughput": (output + sum(r.prompt_tokens for r in ok)) / duration
        if duration
        else 0.0,
    }
    for name, values in (
        ("ttft", [r.ttft for r in ok]),
        ("tpot", tpot),
        ("itl", itl),
        ("e2el", [r.latency for r in ok]),
    ):
        summary[f"mean_{name}_ms"] = 1000 * sum(values) / len(values) if values else float("nan")
        for q in (50, 99):
            summary[f"p{q}_{name}_ms"] = 1000 * percentile(values, q)
    return summary


def print_table(summary: dict[str, float], errors: list[str]) -> None:
    rows = [
        ("Successful requests", f"{summary['completed']:d}"),
        ("Failed requests", f"{summary['failed']:d}"),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", f"{summary['total_input_tokens']:d}"),
        ("Total generated tokens", f"{summary['total_output_tokens']:d}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_token_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
    ]
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        rows.append((f"-- {title} --", ""))
        rows += [
            (f"{stat.capitalize()} {name.upper()} (ms)", f"{summary[f'{stat}_{name}_ms']:.2f}")
            for stat in ("mean", "p50", "p99")
        ]
    width = max(len(k) for k, _ in rows) + 2
    print("=" * (width + 12))
    print(" Serving Benchmark Result ".center(width + 12, "="))
    for key, value in rows:
        print(f"{key:<{width}}{value:>12}" if value else key.center(width + 12, " "))
    print("=" * (width + 12))
    for error in errors[:5]:
        print(f"error: {error}")


def process_cpu_summary(
    before: dict[int, float], after: dict[int, float], server_pid: int
) -> dict[str, float]:
    """CPU seconds each server process spent between two snapshots (children by pid)."""
    out = {}
    for pid, seconds in after.items():
        name = "cpu_server" if pid == server_pid else f"cpu_child_{pid}"
        out[name] = seconds - before.get(pid, 0.0)
    return out


def print_cpu(summary: dict[str, float], duration: float) -> None:
    tokens = summary["total_output_tokens"] or 1
    print("CPU per output token (us) and share of the run's wall time:")
    for key in sorted(k for k in summary if k.startswith("cpu_")):
        seconds = summary[key]
        who = {"cpu_server": "server", "cpu_client": "client"}.get(key, key.removeprefix("cpu_"))
        share = seconds / duration if duration else 0.0
        print(f"  {who:<16}{1e6 * seconds / tokens:>10.0f} us {share:>8.0%}")


def served_models(base_url: str, api_key: str | None) -> list[str]:
    """``GET /v1/models`` before any load is sent, so that a wrong key or URL is one line, not a
    failed request per prompt."""
    import httpx

    url = f"{base_url.rstrip('/')}/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise click.ClickException(f"cannot reach {url}: {e}") from e
    if response.status_code in (401, 403):
        given = "the key given was refused" if api_key else "no key was given"
        raise click.ClickException(
            f"{url} answered {response.status_code} ({given}): pass the server's key with "
            "--api-key KEY or XHAL_API_KEY"
        )
    if response.status_code != 200:
        raise click.ClickException(f"{url} answered {response.status_code}: {response.text[:200]}")
    return [card["id"] for card in response.json()["data"]]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--base-url",
    default="http://127.0.0.1:8000",
    show_default=True,
    help="Server root; requests go to BASE_URL/v1/completions.",
)
@click.option(
    "--model", default=None, help="Model name to request [default: the first in /v1/models]."
)
@click.option("--num-prompts", default=100, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--input-len",
    default=32,
    show_default=True,
    type=click.IntRange(min=1),
    help="Prompt length in words (text prompts) or tokens (--token-ids).",
)
@click.option(
    "--output-len",
    default=32,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens generated per request (max_tokens, with ignore_eos).",
)
@click.option(
    "--request-rate",
    default=float("inf"),
    show_default=True,
    type=float,
    help="Mean arrivals per second of a Poisson process; inf sends all at once.",
)
@click.option(
    "--max-concurrency",
    default=None,
    type=click.IntRange(min=1),
    help="Most requests in flight at once (a fixed-concurrency run with rate inf).",
)
@click.option(
    "--token-ids",
    is_flag=True,
    help="Send prompts as random token ids (exact lengths) instead of text.",
)
@click.option(
    "--vocab-size",
    default=200,
    show_default=True,
    type=click.IntRange(min=1),
    help="Token ids of --token-ids prompts are drawn from [0, VOCAB_SIZE).",
)
@click.option(
    "--api-key",
    default=None,
    envvar="XHAL_API_KEY",
    show_envvar=True,
    help="Sent as `Authorization: Bearer KEY`.",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--result-json",
    default=None,
    type=click.Path(dir_okay=False),
    help="Also write the summary here as JSON.",
)
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@click.option(
    "--server-pid",
    default=None,
    type=int,
    help="Also print the CPU time per output token of this process (the server, e.g. "
    "xhal-serve's API process), of each of its children (the engine process) and of this "
    "client: a process near 100% of the run is what bounds the token rate. Linux only.",
)
def main(
    base_url: str,
    model: str | None,
    num_prompts: int,
    input_len: int,
    output_len: int,
    request_rate: float,
    max_concurrency: int | None,
    token_ids: bool,
    vocab_size: int,
    api_key: str | None,
    seed: int,
    result_json: str | None,
    no_progress: bool,
    server_pid: int | None,
) -> None:
    """Benchmark an OpenAI-compatible server with streaming completions."""
    try:
        import httpx  # noqa: F401
    except ImportError as e:
        raise click.ClickException("xhal-bench-serve needs httpx: pip install httpx") from e
    served = served_models(base_url, api_key)  # checks the key and URL even with --model
    model = model or served[0]
    prompts = make_prompts(num_prompts, input_len, token_ids, vocab_size, seed)
    before = None
    if server_pid is not None:
        from benchmarks.process_cpu import snapshot

        try:
            before = snapshot(server_pid)
        except ValueError as e:
            raise click.ClickException(f"--server-pid: {e}") from e
    client_before = time.process_time()
    results, duration = asyncio.run(
        run_workload(
            base_url,
            model,
            prompts,
            output_len,
            request_rate,
            max_concurrency,
            api_key,
            seed,
            not no_progress,
        )
    )
    summary = summarize(results, duration)
    if before is not None:
        summary |= process_cpu_summary(before, snapshot(server_pid), server_pid)
        summary["cpu_client"] = time.process_time() - client_before
    print_table(summary, [r.error for r in results if not r.ok])
    if before is not None:
        print_cpu(summary, duration)
    if result_json:
        with open(result_json, "w") as f:
            json.dump({"summary": summary, "results": [asdict(r) for r in results]}, f, indent=1)


if __name__ == "__main__":
    main()
