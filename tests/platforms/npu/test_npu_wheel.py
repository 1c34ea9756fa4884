"""The wheel plumbing of the NPU emulation: a cached wheel is used without pip, and ``real_op``
(the one-line registration later ops use) binds, meta-checks and output-checks an op it is given.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.npu_emulation import registry, wheel
from tests.support.npu_emulation_helpers import emulated_npu  # noqa: F401  (fixture)


def test_a_cached_wheel_is_extracted_without_pip(tmp_path: Path, monkeypatch) -> None:
    cached = sorted(wheel.cache_root().glob("torch_npu-*.whl"))
    if not cached:
        pytest.skip("this machine's wheel cache holds no wheel file (extracted files only)")
    monkeypatch.setenv("XHAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(wheel, "_found", None)
    target = wheel.cache_root()
    target.mkdir(parents=True)
    shutil.copy(cached[0], target)

    def no_pip(*args, **kwargs):
        raise AssertionError(f"pip ran although a wheel is cached: {args}")

    monkeypatch.setattr(subprocess, "run", no_pip)
    files = wheel.wheel_files()
    assert files.yaml.is_relative_to(tmp_path) and files.yaml.is_file()
    assert "func: npu_fused_infer_attention_score(" in files.yaml.read_text(encoding="utf-8")
    monkeypatch.setattr(wheel, "_found", None)
    assert wheel.wheel_files() == files  # extracted already: nothing to do


def test_real_op_in_one_line(emulated_npu) -> None:  # noqa: F811
    """An op the emulation does not ship, registered as a later one would be: ``npu_gelu``."""

    def gelu(x, *, approximate="none"):
        return torch.nn.functional.gelu(x, approximate=approximate)

    def wrong_shape(x, *, approximate="none"):
        return x[:1].clone()

    op = registry.real_op("npu_gelu", gelu)  # the one line
    registry.define_all()
    x = torch.randn(3, 8)
    assert torch.allclose(
        op(x, approximate="tanh"), torch.nn.functional.gelu(x, approximate="tanh")
    )
    with pytest.raises(TypeError, match="positional"):
        op(x, "tanh")  # keyword-only in the schema: `Tensor self, *, str approximate`
    with pytest.raises(TypeError, match="'approximate' must be str"):
        op(x, approximate=1)
    assert registry.COUNTS["npu_gelu"]["bound"] >= 1 and registry.COUNTS["npu_gelu"]["meta"] >= 1
    op.kernel = wrong_shape  # a kernel that disagrees with the wheel's meta function is caught
    try:
        with pytest.raises(AssertionError, match="meta function infers"):
            op(x)
    finally:
        op.kernel = gelu
