"""xhal-align prints a per-layer table and points at the first layer a planted bug breaks."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from xhal.tools.align_cli import main

pytest.importorskip("transformers")


def _rows(output: str) -> dict[str, tuple[float, float]]:
    rows = {}
    for line in output.splitlines():
        parts = line.replace("<-- diverges", "").split()
        if len(parts) >= 3 and parts[0] in ("embed", "norm", "logits", "layer"):
            name = " ".join(parts[:2]) if parts[0] == "layer" else parts[0]
            values = parts[2:4] if parts[0] == "layer" else parts[1:3]
            rows[name] = (float(values[0]), float(values[1]))
    return rows


def test_align_prints_a_table_that_agrees(llama_gqa_dir: Path) -> None:
    result = CliRunner().invoke(main, [str(llama_gqa_dir), "--num-tokens", "20"])
    assert result.exit_code == 0, result.output
    rows = _rows(result.stdout)
    assert list(rows) == ["embed", "layer 0", "layer 1", "norm", "logits"]
    assert all(rel <= 1e-4 for _, rel in rows.values())
    assert "all points agree" in result.stdout


def test_align_from_a_text_prompt(llama_gqa_dir: Path) -> None:
    result = CliRunner().invoke(main, [str(llama_gqa_dir), "--prompt", "the quick brown fox jumps"])
    assert result.exit_code == 0, result.output
    assert "5 prompt tokens" in result.stdout


def test_planted_rope_bug_diverges_at_layer_0(qwen3_dir: Path) -> None:
    args = [str(qwen3_dir), "--num-tokens", "20", "--override", "rope_parameters.rope_theta=1234.0"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    rows = _rows(result.stdout)
    assert rows["embed"] == (0.0, 0.0)  # embeddings do not see rope
    assert rows["layer 0"][1] > 1e-3
    assert "first divergence: layer 0" in result.stdout


def test_bad_override_is_a_usage_error(qwen3_dir: Path) -> None:
    result = CliRunner().invoke(main, [str(qwen3_dir), "--override", "no_equals_sign"])
    assert result.exit_code == 2 and "KEY=VALUE" in result.output
