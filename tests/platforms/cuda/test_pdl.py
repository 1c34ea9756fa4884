"""Programmatic dependent launch (``xhal/platforms/cuda/pdl.py``): the switch, the trigger rule,
and the rule every PDL kernel follows, checked on the PTX Triton compiles for sm_90 on any machine
(no GPU needed: a PDL launch itself only runs on the H200, see docs/h200-results.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xhal import env
from xhal.platforms.cuda import pdl


def test_the_switch_defaults_on_and_reads_its_values(monkeypatch) -> None:
    monkeypatch.delenv("XHAL_CUDA_PDL", raising=False)
    monkeypatch.delenv("XHAL_CUDA_PDL_TRIGGER", raising=False)
    assert env.cuda_pdl() is True
    assert env.cuda_pdl_trigger() == "auto"
    monkeypatch.setenv("XHAL_CUDA_PDL", "0")
    assert env.cuda_pdl() is False
    monkeypatch.setenv("XHAL_CUDA_PDL", "maybe")
    with pytest.raises(ValueError, match="XHAL_CUDA_PDL='maybe': use 1 or 0"):
        env.cuda_pdl()
    monkeypatch.setenv("XHAL_CUDA_PDL_TRIGGER", "Late")
    assert env.cuda_pdl_trigger() == "late"
    monkeypatch.setenv("XHAL_CUDA_PDL_TRIGGER", "soon")
    with pytest.raises(ValueError, match="use auto \\(default\\), early or late"):
        env.cuda_pdl_trigger()


def test_cpu_tensors_never_take_pdl(monkeypatch) -> None:
    monkeypatch.setenv("XHAL_CUDA_PDL", "1")
    cpu = torch.device("cpu")
    assert pdl.mode(cpu) == pdl.OFF and pdl.small_kernel(cpu) == pdl.OFF
    assert pdl.launch_options(pdl.OFF) == {}
    assert pdl.launch_options(pdl.EARLY) == {"launch_pdl": True}


def test_auto_triggers_small_gemvs_early_and_large_ones_late() -> None:
    small, large = pdl.EARLY_BYTES - 2, pdl.EARLY_BYTES
    assert pdl.gemv_trigger(pdl.AUTO, small) == pdl.EARLY
    assert pdl.gemv_trigger(pdl.AUTO, large) == pdl.LATE
    for forced in (pdl.OFF, pdl.EARLY, pdl.LATE):
        assert pdl.gemv_trigger(forced, small) == pdl.gemv_trigger(forced, large) == forced


# -- the rule, on the compiled code --------------------------------------------------------------
# The suite runs Triton's interpreter on machines without a GPU (tests/conftest.py), whose kernels
# do not compile; one child process without it compiles every case for sm_90.

_POINTERS = {
    "pos_ptr": "*i32", "slot_ptr": "*i32", "cache_ptr": "*fp32", "part_ptr": "*fp32",
    "sq_ptr": "*fp32", "counter_ptr": "*i32", "weights_ptr": "*fp32", "ids_ptr": "*i32",
}
_GEMV = dict(
    K=512, K_PER_SPLIT=512, M=1, BLOCK_M=1, BLOCK_N=8, BLOCK_K=128, PROLOGUE=1, SPLIT=False,
    HAS_BIAS=False, NUM_STAGES=2,
)
CASES = {  # name: (module, kernel, constexprs)
    "gemv off": ("fused_gemv", "_fused_gemv_kernel", {**_GEMV, "USE_PDL": pdl.OFF}),
    "norm+gemv early": ("fused_gemv", "_fused_gemv_kernel", {**_GEMV, "USE_PDL": pdl.EARLY}),
    "norm+gemv late": ("fused_gemv", "_fused_gemv_kernel", {**_GEMV, "USE_PDL": pdl.LATE}),
    "rotary_kv": (
        "rotary_kv",
        "_rotary_kv_kernel",
        dict(HQ=4, HK=2, D=64, HALF=32, BLOCK_D=64, BLOCK_HALF=32, BLOCK_TAIL=0, IS_NEOX=True,
             USE_PDL=1),
    ),
    "add_rms_norm": ("norm", "_fused_add_rms_norm_kernel", dict(N=256, BLOCK=256, USE_PDL=1)),
    "qk_norm": (
        "qk_norm", "_qk_norm_kernel", dict(H=4, HKV=2, D=64, BLOCK_D=64, HEADS=8, USE_PDL=1)
    ),
    "router": (
        "moe_router",
        "_norm_route_kernel",
        dict(HIDDEN=256, E=16, K=2, NUM_BLOCKS=8, BLOCK_H=256, BLOCK_R=2, BLOCK_E=16, BLOCK_K=2,
             RENORMALIZE=True, USE_PDL=1),
    ),
}


def _compile_all() -> dict[str, str]:
    """sm_90 PTX of every case (bf16 tensors, int32 scalars, fp32 eps); run without the
    interpreter."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = {}
    for case, (module, name, constexprs) in CASES.items():
        kernel = getattr(importlib.import_module(f"xhal.platforms.cuda.kernels.{module}"), name)
        signature = {}
        for arg in kernel.arg_names:
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                signature[arg] = _POINTERS.get(arg, "*bf16")
            else:
                signature[arg] = "fp32" if arg == "eps" else "i32"
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        out[case] = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    return out


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    pytest.importorskip("triton")
    child_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, env=child_env, timeout=600,
        cwd=Path(__file__).resolve().parents[3],
    )
    if done.returncode != 0:
        pytest.skip(f"Triton cannot compile for sm_90 here: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    "case", ["norm+gemv early", "norm+gemv late", "rotary_kv", "add_rms_norm", "qk_norm", "router"]
)
def test_a_pdl_kernel_waits_once_and_writes_nothing_before_its_wait(ptx, case) -> None:
    code = ptx[case]
    assert code.count("griddepcontrol.wait") == 1
    assert code.count("griddepcontrol.launch_dependents") == 1
    before_wait = code.split("griddepcontrol.wait")[0]
    for write in ("st.global", "atom.", "red.", "cp.async.bulk"):
        assert write not in before_wait, f"{case}: {write} before the wait"
    if CASES[case][2]["USE_PDL"] == pdl.LATE:  # the trigger after the weight loop's last load
        after_wait = code.split("griddepcontrol.wait")[1]
        assert after_wait.index("griddepcontrol.launch_dependents") > after_wait.rfind(
            "ld.global"
        )


def test_the_plain_kernel_has_no_pdl_instruction(ptx) -> None:
    assert "griddepcontrol" not in ptx["gemv off"]


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
