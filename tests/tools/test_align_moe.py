"""xhal-align on the mixture-of-experts checkpoints: the table carries each MoE layer's router
logits before the layer's output, and a routing bug shows as agreeing router logits followed by
a diverging layer."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from xhal.tools.align_cli import main

pytest.importorskip("transformers")


def _rows(output: str) -> dict[str, float]:
    """point -> max_rel of every table row."""
    rows = {}
    for line in output.splitlines():
        parts = line.replace("<-- diverges", "").split()
        if len(parts) == 4 and parts[0] in ("layer", "router"):
            rows[f"{parts[0]} {parts[1]}"] = float(parts[3])
        elif len(parts) == 3 and parts[0] in ("embed", "norm", "logits"):
            rows[parts[0]] = float(parts[2])
    return rows


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_moe_table_includes_router_logits_and_agrees(name: str, checkpoint_factory) -> None:
    result = CliRunner().invoke(main, [str(checkpoint_factory(name)), "--num-tokens", "20"])
    assert result.exit_code == 0, result.output
    rows = _rows(result.stdout)
    # qwen2_moe's layer 1 is dense (mlp_only_layers): no router there
    routers = ["router 0"] + ([] if name == "qwen2_moe" else ["router 1"])
    expected = ["embed", "router 0", "layer 0", *routers[1:], "layer 1", "norm", "logits"]
    assert list(rows) == expected
    assert all(rel <= 1e-4 for rel in rows.values()), rows


def test_routing_bug_diverges_after_agreeing_router_logits(checkpoint_factory) -> None:
    """Dropping Qwen3-MoE's renormalization leaves the router logits right and breaks layer 0."""
    path = checkpoint_factory("qwen3_moe")
    args = [str(path), "--num-tokens", "20", "--override", "norm_topk_prob=false"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    rows = _rows(result.stdout)
    assert rows["router 0"] <= 1e-4
    assert rows["layer 0"] > 1e-3
    assert "first divergence: layer 0" in result.stdout
