"""``xhal-serve --device npu`` end to end on the torch_npu emulation (``XHAL_PLUGINS`` loads
``tests.support.npu_emulation.plugin`` into the server and its engine process), driven by the
``openai`` client as tests/serve/test_serve_e2e.py drives the CPU server: chat and completions,
streamed and not, with greedy output equal to ``xhal-serve --device cpu`` on the same checkpoint."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.checkpoints import build_checkpoint
from tests.support.launcher import ServerProcess
from tests.support.npu_emulation.registry import read_counts
from tests.support.npu_emulation_helpers import assert_calls_bound_and_checked
from tests.support.paths import REPO

openai = pytest.importorskip("openai", reason="the server tests drive it with the openai client")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")

API_KEY = "sk-npu"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
PROMPTS = ["the quick brown fox", "hello world one two three four five", "a small model runs"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with head_dim 128 (what FIA's TND layout takes), a word-level tokenizer and a
    chat template."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("npu-serve")
    build_checkpoint(path, "llama", head_dim=128, tokenizer=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


def _serve(model_dir: Path, device: str) -> ServerProcess:
    return ServerProcess([
        "--model", str(model_dir), "--served-model-name", "tiny", "--device", device,
        "--dtype", "bfloat16", "--block-size", "128", "--num-kv-blocks", "32",
        "--max-num-seqs", "8", "--max-model-len", "256", "--api-key", API_KEY,
        "--log-level", "warning",
    ])  # fmt: skip


@pytest.fixture(scope="module")
def counts_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the NPU server's processes write their emulated-call counts."""
    return tmp_path_factory.mktemp("npu-counts")


@pytest.fixture(scope="module")
def servers(model_dir: Path, counts_dir: Path) -> Iterator[dict[str, ServerProcess]]:
    """Both servers, started side by side; the plugin reaches the NPU server's engine process
    through the environment, as it would reach a real deployment's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XHAL_PLUGINS", "tests.support.npu_emulation.plugin")
        mp.setenv("XHAL_NPU_EMULATION_COUNTS", str(counts_dir))
        paths = [str(REPO), os.environ.get("PYTHONPATH")]
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
        npu = _serve(model_dir, "npu").start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("XHAL_PLUGINS", raising=False)
            cpu = _serve(model_dir, "cpu").start()
        try:
            yield {"npu": npu, "cpu": cpu}
        finally:
            cpu.stop()
    finally:
        npu.stop()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _completion(server: ServerProcess, stream: bool) -> list[list[int]]:
    """Greedy token ids per prompt, streamed or not."""
    kw = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})  # fmt: skip
    client = _client(server)
    if not stream:
        out = client.completions.create(prompt=PROMPTS, **kw)
        return [c.token_ids for c in sorted(out.choices, key=lambda c: c.index)]
    ids = []
    for text in PROMPTS:
        chunks = client.completions.create(prompt=text, stream=True, **kw)
        ids.append([t for chunk in chunks for c in chunk.choices for t in (c.token_ids or [])])
    return ids


def _chat(server: ServerProcess, stream: bool) -> list[tuple[str, list[int]]]:
    """(text, greedy token ids) of one chat turn per prompt, streamed or not."""
    kw = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})  # fmt: skip
    client, out = _client(server), []
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        if stream:
            events = client.chat.completions.create(messages=messages, stream=True, **kw)
            chunks = [c for c in events if c.choices]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            out.append((content, [t for c in chunks for t in (c.choices[0].token_ids or [])]))
        else:
            choice = client.chat.completions.create(messages=messages, **kw).choices[0]
            out.append((choice.message.content, choice.token_ids))
    return out


def test_without_torch_npu_the_server_says_what_to_install(model_dir: Path) -> None:
    """The built-in "npu" (no emulation plugin) fails at start with the one clear message."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("XHAL_PLUGINS", raising=False)
        server = _serve(model_dir, "npu")
        # no shortened start-up wait: the server exits with its error, which start() sees
        with pytest.raises(RuntimeError) as info:
            server.start(attempts=1)
    for needle in ("torch_npu", "pip install", "TORCH_DEVICE_BACKEND_AUTOLOAD"):
        assert needle in str(info.value), str(info.value)[-3000:]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_equal_the_cpu_server(servers: dict[str, ServerProcess], stream: bool) -> None:
    npu = _completion(servers["npu"], stream)
    assert all(len(ids) == MAX_TOKENS for ids in npu), npu
    assert npu == _completion(servers["cpu"], stream=False)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_equals_the_cpu_server(servers: dict[str, ServerProcess], stream: bool) -> None:
    npu = _chat(servers["npu"], stream)
    # (ids past the tokenizer's few words decode to nothing, so some texts are short or empty)
    assert all(len(ids) == MAX_TOKENS for _, ids in npu) and any(t.split() for t, _ in npu), npu
    assert npu == _chat(servers["cpu"], stream=False)


def test_every_npu_call_bound_and_checked(
    servers: dict[str, ServerProcess], counts_dir: Path
) -> None:
    """Last in this file: after the requests above, the NPU server stops (its processes save their
    counts) and every emulated torch_npu call it made was bound to the wheel's schema."""
    servers["npu"].stop()
    assert_calls_bound_and_checked(read_counts(counts_dir), "xhal-serve --device npu")
