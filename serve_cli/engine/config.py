"""How the engine is set up: the model, the device and the scheduler's and KV cache's sizes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """Everything ``EngineCore`` needs to start; frozen, checked on construction.

    ``model_dir`` None serves the built-in tiny random model (``serve_cli.default_model``; the
    command line's default, SmolLM2, is resolved to a directory before it gets here).
    ``max_model_len`` None takes the model's ``max_position_embeddings``. The KV cache holds
    ``num_kv_blocks`` blocks, or as many as ``kv_cache_memory`` bytes hold, or (neither given) a
    default budget (``serve_cli.engine.kv_budget``). ``dtype`` "auto" is the checkpoint's.
    ``tensor_parallel_size`` N > 1 shards the model over N processes (this one and N-1 workers,
    one device each); the KV budget is then per rank, each rank holding its share of the KV heads
    in ``num_kv_blocks`` blocks.

    ``async_scheduling`` schedules and builds step N+1 on the host while step N runs on the
    device (its sampled tokens reach step N+1 on the device), and only then reads step N back.
    None (the default) takes the platform's ``async_scheduling`` attribute (off on the CPU,
    where nothing runs asynchronously to overlap with); ``schedules_async`` is the choice made.
    With tensor parallelism rank 0 broadcasts each step's sampled tokens to the workers on the
    device, where the next step's placeholders read them.

    ``enforce_eager`` None (the default) is True on the CPU and False elsewhere: the CPU's
    "graphs" only re-run the recorded ops (no launch overhead to save) and keep every
    intermediate of each captured bucket alive, so a lazily captured prefill bucket per new
    prompt length grew a 135M model's engine from 3 to 7 GB; eager is faster there and flat in
    memory. ``runs_eager`` is the choice made. The fields keep what was asked for (the config
    is frozen and never rewritten); the properties resolve the defaults.
    """

    model_dir: str | Path | None = None
    device: str = "cpu"
    dtype: str = "auto"
    load_format: str = "auto"  # "dummy": random weights, only config.json and a tokenizer needed
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes per rank, across all layers (K and V)
    num_kv_blocks: int | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    async_scheduling: bool | None = None
    log_stats_interval: float = 10.0  # seconds between the engine's stats lines; 0: none

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size")
        for name in positive:
            _check_positive(name, getattr(self, name))
        for name in ("max_model_len", "kv_cache_memory", "num_kv_blocks"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if not isinstance(self.log_stats_interval, (int, float)) or self.log_stats_interval < 0:
            raise ValueError(
                f"log_stats_interval must be >= 0 seconds, got {self.log_stats_interval!r}"
            )
        if self.kv_cache_memory is not None and self.num_kv_blocks is not None:
            raise ValueError("give at most one of kv_cache_memory (bytes) and num_kv_blocks")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("async_scheduling", "enforce_eager"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean or None, got {value!r}")
        _platform_attribute(self.device, "async_scheduling")  # refuse an unknown device now

    @property
    def schedules_async(self) -> bool:
        """Whether steps overlap: ``async_scheduling``, or when None the platform's default."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return bool(_platform_attribute(self.device, "async_scheduling"))

    @property
    def runs_eager(self) -> bool:
        """Whether the executor runs without graphs: ``enforce_eager``, or when None True for the
        "cpu" platform only (an emulated device on CPU tensors still captures its graphs)."""
        if self.enforce_eager is not None:
            return self.enforce_eager
        return self.device.split(":")[0] == "cpu"


def _platform_attribute(device: str, name: str):
    """A class attribute of ``device``'s platform ("cuda:1" names platform "cuda"), read without
    creating the platform (that imports device libraries). A platform registered as a factory
    rather than a class has no class to read: it gets the ``Platform`` defaults."""
    import xhal.platforms
    from xhal.interfaces.platform import Platform

    try:
        cls = xhal.platforms.platform_class(device.split(":")[0])
    except KeyError:
        known = ", ".join(xhal.platforms.names())
        raise ValueError(
            f"unknown device {device!r}; the registered platforms are: {known}"
        ) from None
    return getattr(cls, name, getattr(Platform, name))


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
