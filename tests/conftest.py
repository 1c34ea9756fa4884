"""Shared fixtures: tiny random checkpoints (built once per session; see
tests/support/checkpoints.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import BUILDERS

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally; never reach the hub
if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter here. Set before any test module is collected:
    # triton decides per kernel when the kernel is defined, so a module that imports a kernel file
    # before tests/support/triton_env.py would otherwise leave that kernel compiled-only.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``factory(name)`` -> directory of the ``checkpoints.BUILDERS[name]`` checkpoint (cached)."""
    pytest.importorskip("transformers", reason="tiny checkpoints are built with transformers")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            # the GQA Llama also gets a tokenizer, for tests that start from text
            kwargs = {"tokenizer": True} if name == "llama_gqa" else {}
            built[name] = BUILDERS[name](path, **kwargs)
        return built[name]

    return get


@pytest.fixture(scope="session")
def llama_gqa_dir(checkpoint_factory: Callable[[str], Path]) -> Path:
    """Llama, 4 heads / 2 KV heads, llama3 rope scaling, with a word-level tokenizer."""
    return checkpoint_factory("llama_gqa")


@pytest.fixture(scope="session")
def llama_tied_dir(checkpoint_factory: Callable[[str], Path]) -> Path:
    return checkpoint_factory("llama_tied")


@pytest.fixture(scope="session")
def llama_sharded_dir(checkpoint_factory: Callable[[str], Path]) -> Path:
    return checkpoint_factory("llama_sharded")


@pytest.fixture(scope="session")
def qwen2_dir(checkpoint_factory: Callable[[str], Path]) -> Path:
    return checkpoint_factory("qwen2")


@pytest.fixture(scope="session")
def qwen3_dir(checkpoint_factory: Callable[[str], Path]) -> Path:
    return checkpoint_factory("qwen3")


@pytest.fixture(params=sorted(BUILDERS))
def tiny_checkpoint(request: pytest.FixtureRequest, checkpoint_factory) -> Path:
    """Each tiny checkpoint in turn."""
    return checkpoint_factory(request.param)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Torch on one CPU thread for a module (``pytestmark = pytest.mark.usefixtures(...)``): tiny
    matmuls only gain contention from more threads on a busy CI machine."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def fail_first_call(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``fail_first_call(owner, name)``: ``owner.name`` raises an injected device fault
    (``RuntimeError``) on its first call and works from then on."""

    def install(owner: object, name: str, message: str = "injected device fault") -> None:
        original, calls = getattr(owner, name), []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError(message)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, failing)

    return install
