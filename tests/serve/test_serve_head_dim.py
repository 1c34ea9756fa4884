"""``xhal-serve --device cpu`` serves a checkpoint whose head dim (16) no kernel library lists: the
CPU reference declares any head dim, and the served greedy tokens equal transformers'."""

from __future__ import annotations

import pytest
import torch

from tests.support.checkpoints import llama_head_dim_16
from tests.support.launcher import ServerProcess

openai = pytest.importorskip("openai", reason="the server tests drive it with the openai client")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")
transformers = pytest.importorskip("transformers")

API_KEY = "sk-head-dim"


def test_served_greedy_tokens_equal_transformers(tmp_path) -> None:
    path = llama_head_dim_16(tmp_path / "llama-d16", tokenizer=True)
    prompt = "the quick brown fox jumps over the lazy dog"
    ids = transformers.AutoTokenizer.from_pretrained(str(path))(prompt)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    expected, tokens = [], list(ids)
    with torch.no_grad():  # plain argmax steps: generate() would suppress EOS until min length
        for _ in range(8):
            expected.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
            tokens.append(expected[-1])
    args = ["--model", str(path), "--device", "cpu", "--served-model-name", "d16",
            "--max-model-len", "256", "--num-kv-blocks", "32", "--api-key", API_KEY,
            "--log-level", "warning"]  # fmt: skip
    with ServerProcess(args) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        out = client.completions.create(
            model="d16",
            prompt=ids,
            max_tokens=8,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    assert out.choices[0].token_ids == expected
