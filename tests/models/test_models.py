"""xhal's models against transformers on tiny random checkpoints, and the loader's errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import WeightsMismatchError, get_model_class, load_model, supported_architectures
from models.loader import safetensors_files
from xhal.layers import attention_layers
from xhal.tools.align import xhal_prefill

transformers = pytest.importorskip("transformers")

NUM_TOKENS = 37  # three blocks of 16, the last one partial


def _prompt(vocab_size: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (NUM_TOKENS,), generator=generator, dtype=torch.int32)


def _hf_logits(model_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return hf(input_ids=input_ids.long().view(1, -1), use_cache=False).logits[0].float()


def test_logits_match_transformers(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint, dtype=torch.float32, progress=False)
    input_ids = _prompt(model.config["vocab_size"])
    hidden, logits = xhal_prefill(model, input_ids)
    expected = _hf_logits(tiny_checkpoint, input_ids)
    assert hidden.shape == (NUM_TOKENS, model.config["hidden_size"])
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    rel = (logits - expected).abs().max() / expected.abs().max()
    assert rel <= 1e-4, f"max relative difference {float(rel):.2e}"


def test_model_structure(llama_gqa_dir: Path) -> None:
    model = load_model(llama_gqa_dir, dtype=torch.float32, progress=False)
    num_layers = model.config["num_hidden_layers"]
    assert len(model.model.layers) == num_layers
    assert [a.layer_id for a in attention_layers(model)] == list(range(num_layers))
    attn = model.model.layers[0].self_attn.attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (4, 2, 64)
    # the rope cache stays float32 whatever the model's dtype
    bf16 = load_model(llama_gqa_dir, dtype="bfloat16", progress=False)
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16.model.rotary_emb.cos_sin_cache.dtype == torch.float32


def test_tied_embeddings_share_one_tensor(llama_tied_dir: Path) -> None:
    model = load_model(llama_tied_dir, progress=False)  # dtype auto: float32 from config.json
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float32


def test_sharded_checkpoint_uses_its_index(llama_sharded_dir: Path, tmp_path: Path) -> None:
    """The loader reads the shards the index names, every one and nothing else: a stray file
    beside them is ignored (the same logits as transformers'), a named shard gone is an error
    naming it. (Without the index every *.safetensors file would be read, the stray one too.)"""
    index = json.loads((llama_sharded_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert [f.name for f in safetensors_files(llama_sharded_dir)] == shards
    copy = _copy_with(llama_sharded_dir, tmp_path / "stray")
    save_file({"stray.weight": torch.zeros(2)}, copy / "zz-stray.safetensors")
    model = load_model(copy, dtype=torch.float32, progress=False)  # would be a mismatch otherwise
    input_ids = _prompt(model.config["vocab_size"])
    expected = _hf_logits(llama_sharded_dir, input_ids)
    rel = (xhal_prefill(model, input_ids)[1] - expected).abs().max() / expected.abs().max()
    assert rel <= 1e-4, f"max relative difference {float(rel):.2e}"
    (copy / shards[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=f"shards that are missing: .*{shards[-1]}"):
        load_model(copy, dtype=torch.float32, progress=False)


def _copy_with(src: Path, dst: Path, edit_config=None, edit_tensors=None) -> Path:
    shutil.copytree(src, dst)
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    if edit_tensors:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors")
    return dst


def test_unknown_architecture_lists_supported(llama_tied_dir: Path, tmp_path: Path) -> None:
    bad = _copy_with(
        llama_tied_dir,
        tmp_path / "m",
        edit_config=lambda c: c.update(architectures=["FooForCausalLM"]),
    )
    with pytest.raises(KeyError, match="FooForCausalLM") as err:
        load_model(bad, progress=False)
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(err.value)
    with pytest.raises(KeyError, match="supported: .*LlamaForCausalLM"):
        get_model_class("FooForCausalLM")
    assert "MistralForCausalLM" in supported_architectures()


def test_missing_tensor_is_named(llama_tied_dir: Path, tmp_path: Path) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    bad = _copy_with(llama_tied_dir, tmp_path / "m", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(
        WeightsMismatchError, match=r"missing 1 tensor\(s\): " + name.replace(".", r"\.")
    ):
        load_model(bad, progress=False)


def test_unexpected_tensor_is_named(llama_tied_dir: Path, tmp_path: Path) -> None:
    def add(tensors: dict) -> None:
        tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(32)  # skipped

    bad = _copy_with(llama_tied_dir, tmp_path / "m", edit_tensors=add)
    with pytest.raises(
        WeightsMismatchError, match=r"unexpected 1 tensor\(s\): model\.layers\.0\.self_attn\.extra"
    ):
        load_model(bad, progress=False)


def test_wrong_shape_names_the_tensor(llama_tied_dir: Path, tmp_path: Path) -> None:
    bad = _copy_with(
        llama_tied_dir, tmp_path / "m", edit_config=lambda c: c.update(intermediate_size=96)
    )
    with pytest.raises(
        WeightsMismatchError, match=r"'model\.layers\.0\.mlp\.\w+\.weight'.*expected"
    ):
        load_model(bad, progress=False)


def test_dummy_load_format_needs_only_config(tmp_path, checkpoint_factory):
    """load_format="dummy" builds the model from config.json alone with seeded random weights."""
    config = json.loads((checkpoint_factory("qwen3") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    a = load_model(tmp_path, dtype=torch.float32, load_format="dummy", progress=False)
    b = load_model(tmp_path, dtype=torch.float32, load_format="dummy", progress=False)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" in name:
            assert torch.all(pa == 1)
    assert 0.015 < float(a.lm_head.weight.std()) < 0.025
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path, load_format="auto", progress=False)
    with pytest.raises(ValueError, match="load_format"):
        load_model(tmp_path, load_format="random", progress=False)
