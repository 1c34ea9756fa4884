"""Platform family: the ``Platform`` contract itself (identity, registry, declared capabilities,
clear errors, lazy imports), independent of any numerics."""

from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess
import sys

import pytest
import torch

import xhal
from xhal.interfaces import (
    AttentionBackend,
    AttentionSpec,
    Collective,
    DeviceOps,
    GraphRunner,
    Platform,
)

DEVICE_LIBRARIES = ("flashinfer", "triton", "tilelang", "torch_npu")


def test_identity(platform: Platform, device_name: str) -> None:
    assert isinstance(platform, Platform)
    assert platform.name == device_name, (
        f"registered as {device_name!r}, calls itself {platform.name!r}"
    )
    for attr in ("name", "device_type", "dist_backend"):
        value = getattr(platform, attr)
        assert isinstance(value, str) and value, (
            f"Platform.{attr} must be a non-empty str, got {value!r}"
        )
    assert torch.device(platform.device_type).type == platform.device_type
    assert platform.device().type == platform.device_type, "device() is not of device_type"
    # torch.distributed normalizes backend names to lower case; an alias would break that lookup
    assert platform.dist_backend == platform.dist_backend.lower()
    assert type(platform).is_available() is True, "is_available() must be True where it runs"
    assert type(platform).metadata_convention in ("cuda", "npu"), (
        f"metadata_convention {type(platform).metadata_convention!r}: use 'cuda' or 'npu'"
    )
    assert isinstance(type(platform).async_scheduling, bool), "async_scheduling must be a bool"
    assert type(platform).interface_version == xhal.interfaces.INTERFACE_VERSION


def test_platform_for_another_interface_version_is_refused() -> None:
    """A plugin pinned to another interface version fails at ``get`` with both versions named."""
    current = xhal.interfaces.INTERFACE_VERSION
    stale = type("StalePlatform", (), {"interface_version": current + 1})
    xhal.platforms.register("xhal-conformance-stale", stale)
    try:
        with pytest.raises(RuntimeError, match=f"version {current + 1}.*version {current}"):
            xhal.platforms.get("xhal-conformance-stale")
    finally:
        xhal.platforms.unregister("xhal-conformance-stale")


def test_registry_returns_one_instance(platform: Platform, device_name: str) -> None:
    assert xhal.platforms.get(device_name) is platform
    assert xhal.platforms.get(device_name) is xhal.platforms.get(device_name)
    assert device_name in xhal.platforms.names()
    assert device_name in xhal.platforms.available()


def test_capabilities_are_frozen_data(platform: Platform) -> None:
    caps = platform.capabilities
    for obj in (caps, caps.attention):
        assert dataclasses.is_dataclass(obj), f"{type(obj).__name__} is not a dataclass"
        assert type(obj).__dataclass_params__.frozen, f"{type(obj).__name__} is not frozen"
        field = dataclasses.fields(obj)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, getattr(obj, field))
    att = caps.attention
    assert att.dtypes and att.head_dims and att.block_sizes, "declare at least one of each"
    assert caps.ops_dtypes, "declare at least one ops dtype"
    for block_size in att.block_sizes:
        assert block_size % att.block_size_multiple == 0, (
            f"declared block size {block_size} is not a multiple of block_size_multiple "
            f"{att.block_size_multiple}"
        )


def spec(dtype: torch.dtype, head_dim: int, block_size: int, **kw) -> AttentionSpec:
    return AttentionSpec(
        num_heads=8, num_kv_heads=2, head_dim=head_dim, dtype=dtype, block_size=block_size, **kw
    )


def test_declared_attention_specs_work(platform: Platform) -> None:
    att = platform.capabilities.attention
    for dtype, head_dim, block_size in itertools.product(
        att.dtypes, att.head_dims, att.block_sizes
    ):
        s = spec(dtype, head_dim, block_size)
        backend = platform.attention_backend(s)
        assert isinstance(backend, AttentionBackend) and backend.spec == s
        got = tuple(backend.kv_cache_shape(7))
        assert got == (7, block_size, 2, head_dim), (
            f"{s}: kv_cache_shape(7) is {got}, expected "
            "[num_blocks, block_size, num_kv_heads, head_dim]"
        )
    base = (att.dtypes[0], att.head_dims[0], att.block_sizes[0])
    if att.sliding_window:
        platform.attention_backend(spec(*base, sliding_window=32))
    if att.logits_soft_cap:
        platform.attention_backend(spec(*base, logits_soft_cap=30.0))


def undeclared_specs(platform: Platform) -> list[tuple[str, AttentionSpec, list[str]]]:
    """(what is wrong, the spec, strings an actionable message must contain)."""
    att = platform.capabilities.attention
    dtype, head_dim, block_size = att.dtypes[0], att.head_dims[0], att.block_sizes[0]
    cases = []
    bad_dtype = next(
        d
        for d in (torch.float64, torch.float16, torch.bfloat16, torch.float32)
        if d not in att.dtypes
    )
    cases.append(("dtype", spec(bad_dtype, head_dim, block_size), [str(bad_dtype), str(dtype)]))
    if not att.any_head_dim:
        bad_head_dim = next(d for d in (40, 72, 200, 24) if d not in att.head_dims)
        cases.append(
            ("head_dim", spec(dtype, bad_head_dim, block_size), [str(bad_head_dim), str(head_dim)])
        )
    if att.block_size_multiple > 1:
        bad = att.block_size_multiple + 1
        cases.append(
            ("block_size", spec(dtype, head_dim, bad), [str(bad), str(att.block_size_multiple)])
        )
    if not att.sliding_window:
        cases.append(
            ("sliding_window", spec(dtype, head_dim, block_size, sliding_window=32), ["sliding"])
        )
    if not att.logits_soft_cap:
        cases.append(
            ("logits_soft_cap", spec(dtype, head_dim, block_size, logits_soft_cap=30.0), ["soft"])
        )
    return cases


def test_undeclared_spec_raises_actionable_error(platform: Platform) -> None:
    for what, s, needles in undeclared_specs(platform):
        with pytest.raises(ValueError) as info:
            platform.attention_backend(s)
        message = str(info.value)
        missing = [n for n in needles if n not in message]
        assert not missing, f"undeclared {what}: message {message!r} does not mention {missing}"


def test_any_head_dim_accepts_undeclared_head_dims(platform: Platform) -> None:
    """A platform declaring ``any_head_dim`` serves head dims outside its tested sample."""
    att = platform.capabilities.attention
    if not att.any_head_dim:
        pytest.skip(f"{platform.name} declares a fixed list of head dims")
    for head_dim in (8, 40, 96, 160):
        platform.attention_backend(spec(att.dtypes[0], head_dim, att.block_sizes[0]))


def test_components(platform: Platform) -> None:
    assert isinstance(platform.ops, DeviceOps)
    assert platform.ops is platform.ops, "ops is per platform, not rebuilt per access"
    if platform.capabilities.graphs:
        assert isinstance(platform.graph_runner(), GraphRunner)
    assert isinstance(platform.collective(None), Collective)


def test_runtime_services(platform: Platform) -> None:
    """``mem_get_info`` is what the engine sizes its KV cache from: the total is the device's and
    does not move, and the free memory it reports can really be allocated, on the device; where
    the device is not the host's memory, holding a block shows in the free count, and
    ``empty_cache`` after freeing it shows it free again (the decode graphs' memory figure reads
    the free count that way)."""
    platform.synchronize()
    free, total = platform.mem_get_info()
    assert isinstance(free, int) and isinstance(total, int) and 0 <= free <= total and total > 0
    block = min(free // 4, 256 << 20)  # bytes; a quarter of free, so other tenants do not matter
    held = torch.empty(block, dtype=torch.uint8, device=platform.device())
    held.fill_(1)  # touched: memory the OS only promised is not held
    platform.synchronize()
    free_held, total_held = platform.mem_get_info()
    assert total_held == total, "the device's total memory changed while a tensor was allocated"
    if platform.device_type != "cpu" and block >= 64 << 20:  # the host's free count is noisy
        assert free - free_held >= block // 2, (
            f"holding {block} bytes on {platform.device()} lowered the reported free memory by "
            f"only {free - free_held}"
        )
    del held
    platform.empty_cache()  # gives the freed block back where the allocator caches it
    free_after, _ = platform.mem_get_info()
    if platform.device_type != "cpu" and block >= 64 << 20:
        assert free_after - free_held >= block // 2, (
            f"empty_cache() after freeing {block} bytes on {platform.device()} raised the "
            f"reported free memory by only {free_after - free_held}"
        )


def test_unknown_platform_lists_known_names() -> None:
    with pytest.raises(KeyError) as info:
        xhal.platforms.get("no-such-device")
    message = str(info.value)
    assert "no-such-device" in message
    missing = [n for n in xhal.platforms.names() if n not in message]
    assert not missing, f"KeyError {message!r} does not list the known platforms {missing}"


def test_import_is_lazy() -> None:
    """``import xhal`` plus ``available()`` imports no device library (every platform's
    ``is_available`` must stay cheap), in a fresh interpreter with this process's plugins."""
    probe = (
        "import sys, xhal\n"
        "xhal.platforms.available()\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {DEVICE_LIBRARIES!r}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    imported = proc.stdout.strip().splitlines()[-1]
    assert imported == "[]", f"import xhal; xhal.platforms.available() imported {imported}"
