"""What a platform declares, as the labels the suite's numeric tests say they exercised.

A test that checked numbers for a declared capability records its labels (``record_coverage``);
``xhal-conformance`` compares the labels of the tests that passed with ``declared(...)`` and fails
the run when a declared capability was never exercised, so a declaration the suite cannot reach
(a block size no case uses, a head dim outside the grid) is caught instead of reading "passed".
A test that cannot run on this machine (one device where a group needs two) records
``CANNOT_EXERCISE`` with the label instead: reported, not counted as missing.
"""

from __future__ import annotations

import pytest
import torch

from xhal.interfaces import AttentionSpec, BatchKind, Capabilities

COVERS = "covers"
CANNOT_EXERCISE = "cannot_exercise"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def attention_labels(spec: AttentionSpec, kind: BatchKind | None = None) -> list[str]:
    labels = [
        f"attention dtype {dtype_name(spec.dtype)}",
        f"attention head_dim {spec.head_dim}",
        f"attention block_size {spec.block_size}",
    ]
    if spec.sliding_window is not None:
        labels.append("attention sliding_window")
    if spec.logits_soft_cap is not None:
        labels.append("attention logits_soft_cap")
    if kind is not None:
        labels.append(f"attention kind {kind.name}")
    return labels


def declared(capabilities: Capabilities) -> dict[str, set[str]]:
    """Family -> the labels its numeric tests must exercise for this declaration."""
    att = capabilities.attention
    attention = {f"attention dtype {dtype_name(d)}" for d in att.dtypes}
    attention |= {f"attention head_dim {d}" for d in att.head_dims}
    attention |= {f"attention block_size {b}" for b in att.block_sizes}
    attention |= {f"attention kind {k.name}" for k in att.batch_kinds if k != BatchKind.EMPTY}
    if att.sliding_window:
        attention.add("attention sliding_window")
    if att.logits_soft_cap:
        attention.add("attention logits_soft_cap")
    out = {
        "attention": attention,
        "ops": {f"ops dtype {dtype_name(d)}" for d in capabilities.ops_dtypes},
    }
    if capabilities.graphs:
        out["graph"] = {f"graph attention dtype {dtype_name(d)}" for d in att.dtypes}
    if capabilities.collective:
        out["collective"] = {"collective world group", "collective sub-groups"}
    return out


def cannot_exercise(request: pytest.FixtureRequest, label: str, reason: str) -> None:
    """Skip a test this machine cannot run, noting the declared capability it would exercise."""
    request.node.user_properties.append((CANNOT_EXERCISE, f"{label} ({reason})"))
    pytest.skip(reason)
