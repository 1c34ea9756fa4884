"""The built-in default model: generated once (atomically) and reused, loadable by transformers and
by xhal, identical wherever it is generated, and served deterministically."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from serve_cli.default_model import NAME, TEXT, ensure_default_model
from serve_cli.engine.offline import generate

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def model_dir(cache: Path) -> Path:
    return ensure_default_model(cache)


def test_generated_once_then_reused(cache: Path, model_dir: Path) -> None:
    assert model_dir == cache / NAME
    stamps = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(stamps)
    assert ensure_default_model(cache) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == stamps
    assert os.listdir(cache) == [NAME], "the temporary directory was left behind"


def test_cache_dir_defaults_to_xhal_cache_dir(model_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("XHAL_CACHE_DIR", str(model_dir.parent))
    assert ensure_default_model() == model_dir


def test_same_files_wherever_generated(model_dir: Path, tmp_path: Path) -> None:
    other = ensure_default_model(tmp_path)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (other / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_tokenizer_and_chat_template(model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    assert len(tok) == config.vocab_size and config.architectures == ["LlamaForCausalLM"]
    assert (tok.bos_token_id, tok.eos_token_id) == (config.bos_token_id, config.eos_token_id)
    assert tok.pad_token_id is not None
    for line in TEXT.splitlines() + ["Unseen wörds ✓ 日本"]:
        ids = tok(line)["input_ids"]
        assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == line
    assert len(tok("the river ran quietly")["input_ids"]) <= 6, "BPE merges were not learned"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<s><|user|>\nHi</s>\n<|assistant|>\n"


def test_loads_and_generates_deterministically(model_dir: Path) -> None:
    from serve_cli.engine.config import EngineConfig
    from serve_cli.engine.core import EngineCore
    from serve_cli.engine.sampling import SamplingParams

    config = EngineConfig(model_dir=model_dir, max_model_len=64, num_kv_blocks=16)
    engine = EngineCore(config)
    prompt = engine.tokenizer("What time is it?")["input_ids"]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = generate(engine, [prompt], greedy)
    assert generate(engine, [prompt], greedy) == first
    assert generate(EngineCore(config), [prompt], greedy) == first

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert first == [ids[len(prompt) :]]
