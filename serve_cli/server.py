"""Runs the API process: start the engine process, load the tokenizer, serve HTTP (uvicorn).

Shutdown: SIGINT or SIGTERM makes uvicorn stop accepting, lets open requests finish for
``--shutdown-timeout`` seconds and then ends the rest in-band (``serve_cli.shutdown``), and runs
the app's lifespan exit, which stops the engine process; the ``finally`` below stops it too when
start-up fails half-way. The engine process also dies on its own if this process dies (see
``process.engine_process``), so no process is left behind. If the engine process dies first, the
server answers its requests with 503s, stops, and ``serve`` raises ``EngineDeadError`` (exit status
1).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from serve_cli.api import ServerState, build_app
from serve_cli.api.defaults import load_request_defaults
from serve_cli.engine.config import EngineConfig
from serve_cli.preflight import small_kv_warning
from serve_cli.process.engine_client import EngineClient, EngineDeadError, EngineStartupError
from serve_cli.shutdown import BACKSTOP_S, Drain, GracefulServer, exit_when_engine_dies

logger = logging.getLogger("xhal.serve")


@dataclass(frozen=True)
class ServerOptions:
    host: str
    port: int
    model_dir: Path
    model_name: str
    api_key: str | None = None
    log_level: str = "info"
    default_max_tokens: int | None = None  # chat requests without a limit (None: the model's)
    log_prompts: bool = False
    shutdown_timeout: float = 10.0  # seconds in-flight requests get after SIGTERM / Ctrl-C
    tool_call_parser: str | None = None  # chat requests may offer tools (api/tool_calls.py)


def serve(options: ServerOptions, config: EngineConfig) -> None:
    """Serve until SIGINT / SIGTERM; raises ``EngineStartupError`` if the engine cannot start,
    ``EngineDeadError`` if it died while serving."""
    logging.basicConfig(
        level=options.log_level.upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(_serve(options, config))
    except KeyboardInterrupt:
        pass


async def _serve(options: ServerOptions, config: EngineConfig) -> None:
    client = EngineClient(config, options.log_level)
    try:
        tokenizer_task = asyncio.create_task(asyncio.to_thread(_load_tokenizer, options.model_dir))
        try:
            info = await client.start()
        except EngineStartupError as engine_error:
            # the engine reads the same tokenizer; when that is what failed, say so by name
            try:
                await tokenizer_task
            except EngineStartupError as tokenizer_error:
                raise tokenizer_error from None
            raise engine_error from None
        if config.num_kv_blocks is None and config.kv_cache_memory is None:  # sized on start
            warning = small_kv_warning(info.num_kv_blocks, info.block_size, info.max_model_len)
            if warning:
                logger.warning(warning)
        tokenizer = await tokenizer_task
        client.attach_tokenizer(tokenizer)  # it makes the text of the engine's token ids
        state = ServerState(
            client=client,
            tokenizer=tokenizer,
            model_name=options.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            block_size=info.block_size,
            num_kv_blocks=info.num_kv_blocks,
            api_key=options.api_key,
            created=int(time.time()),
            defaults=load_request_defaults(options.model_dir, options.default_max_tokens),
            model_root=str(options.model_dir),
            log_prompts=options.log_prompts,
            tool_call_parser=options.tool_call_parser,
        )
        drain = Drain(state, client, options.shutdown_timeout)
        server = GracefulServer(
            uvicorn.Config(
                build_app(state, on_shutdown=client.shutdown),
                host=options.host,
                port=options.port,
                log_level=options.log_level,
                timeout_graceful_shutdown=options.shutdown_timeout + BACKSTOP_S,
            ),
            on_first_signal=drain.begin,
        )
        exit_when_engine_dies(client, server)
        announcer = asyncio.create_task(_announce_when_ready(server, options))
        await server.serve()
        announcer.cancel()
        if client.is_dead:
            raise EngineDeadError(
                f"{client.dead_reason.removesuffix('; restart xhal-serve')}; xhal-serve answered "
                "its requests and exits (status 1) for a supervisor to restart it"
            )
    finally:
        await client.shutdown()


async def _announce_when_ready(server: uvicorn.Server, options: ServerOptions) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    host = f"[{options.host}]" if ":" in options.host else options.host
    sockets = [sock for listener in server.servers for sock in listener.sockets]
    port = sockets[0].getsockname()[1] if sockets else options.port  # the real one for --port 0
    print(
        f"xhal-serve: ready, serving {options.model_name!r} at http://{host}:{port}/v1 "
        "(Ctrl-C to stop)",
        flush=True,
    )


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises many kinds; the user needs one line
        logger.debug("loading the tokenizer failed", exc_info=True)
        files = ", ".join(sorted(p.name for p in model_dir.glob("tokenizer*"))) or "none"
        detail = " ".join(f"{type(e).__name__}: {e}".split())
        raise EngineStartupError(
            f"cannot load the tokenizer of {model_dir} (tokenizer files: {files}): {detail}"
        ) from None
