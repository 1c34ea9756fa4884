"""Programmatic dependent launch (``xhal/platforms/cuda/pdl.py``): the switch, the trigger rule,
and the rule every PDL kernel follows, checked on the PTX Triton compiles for sm_90 on any machine
(no GPU needed: a PDL launch itself only runs on the H200, see docs/h200-results.md)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.support.sm90_builds import compiled_in_child
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
    monkeypatch.setenv("XHAL_CUDA_PDL_TRIGGER", "by-size")
    assert env.cuda_pdl_trigger() == "by-size"
    monkeypatch.setenv("XHAL_CUDA_PDL_TRIGGER", "soon")
    with pytest.raises(ValueError, match="use auto \\(default\\), by-size, early or late"):
        env.cuda_pdl_trigger()


def test_the_overlap_switch_names_its_parts(monkeypatch) -> None:
    monkeypatch.delenv("XHAL_CUDA_OVERLAP", raising=False)
    assert env.cuda_overlap() == {"mlp", "qkv", "o"}
    monkeypatch.setenv("XHAL_CUDA_OVERLAP", "1")
    assert env.cuda_overlap() == {"mlp", "qkv", "o"}
    monkeypatch.setenv("XHAL_CUDA_OVERLAP", "0")
    assert env.cuda_overlap() == frozenset()
    monkeypatch.setenv("XHAL_CUDA_OVERLAP", "O, qkv")
    assert env.cuda_overlap() == {"o", "qkv"}
    monkeypatch.setenv("XHAL_CUDA_OVERLAP", "mlp,attention")
    with pytest.raises(ValueError, match="use 1, 0 or a comma list of mlp, qkv, o"):
        env.cuda_overlap()


def test_the_split_kv_launch_triggers_early_for_one_sequence_with_o_beside(monkeypatch) -> None:
    from xhal.platforms.cuda.kernels import splitkv_decode

    monkeypatch.delenv("XHAL_CUDA_OVERLAP", raising=False)
    assert splitkv_decode.trigger(1) == pdl.EARLY
    assert splitkv_decode.trigger(2) == splitkv_decode.TRIGGER == pdl.LATE
    monkeypatch.setenv("XHAL_CUDA_OVERLAP", "mlp,qkv")
    assert splitkv_decode.trigger(1) == pdl.LATE
    monkeypatch.setenv("XHAL_CUDA_OVERLAP", "0")
    assert splitkv_decode.trigger(1) == pdl.LATE


def test_cpu_tensors_never_take_pdl(monkeypatch) -> None:
    monkeypatch.setenv("XHAL_CUDA_PDL", "1")
    cpu = torch.device("cpu")
    assert pdl.mode(cpu) == pdl.OFF and pdl.small_kernel(cpu) == pdl.OFF
    assert pdl.launch_options(pdl.OFF) == {}
    assert pdl.launch_options(pdl.EARLY) == {"launch_pdl": True}


def test_auto_triggers_small_gemvs_early_and_large_ones_and_norm_gemvs_late() -> None:
    small, large = pdl.EARLY_BYTES - 2, pdl.EARLY_BYTES
    for rule in (pdl.AUTO, pdl.BY_SIZE):
        assert pdl.gemv_trigger(rule, small) == pdl.EARLY
        assert pdl.gemv_trigger(rule, large) == pdl.LATE
    # the add + RMSNorm GEMVs (qkv ahead of attention, gate_up): late at every size under AUTO,
    # by size under BY_SIZE (the rule before)
    assert pdl.gemv_trigger(pdl.AUTO, small, norm=True) == pdl.LATE
    assert pdl.gemv_trigger(pdl.BY_SIZE, small, norm=True) == pdl.EARLY
    for forced in (pdl.OFF, pdl.EARLY, pdl.LATE):
        for norm in (False, True):
            assert pdl.gemv_trigger(forced, small, norm) == forced
            assert pdl.gemv_trigger(forced, large, norm) == forced


# -- the rule, on the compiled code --------------------------------------------------------------
# The suite runs Triton's interpreter on machines without a GPU (tests/conftest.py), whose kernels
# do not compile; one child process without it compiles every case for sm_90.

_POINTERS = {
    "pos_ptr": "*i32", "slot_ptr": "*i32", "cache_ptr": "*fp32", "part_ptr": "*fp32",
    "sq_ptr": "*fp32", "counter_ptr": "*i32", "weights_ptr": "*fp32", "ids_ptr": "*i32",
    "block_table_ptr": "*i32", "kv_lens_ptr": "*i32", "part_acc_ptr": "*fp32",
    "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "rot_ptr": "*fp32", "epoch_ptr": "*i32",
    "clock_ptr": "*i64",
}
_FLOATS = ("eps", "scale_log2", "soft_cap")
_GEMV = dict(
    K=512, K_PER_SPLIT=512, M=1, BLOCK_M=1, BLOCK_N=8, BLOCK_K=128, PROLOGUE=1, SPLIT=False,
    HAS_BIAS=False, NUM_STAGES=2, TMA=False,
)
_SPLITKV = dict(  # the fused decode layer (new token + rotary) of the 8B shape, 16 splits
    GROUP=4, GROUP_PAD=4, ROWS=16, HEAD_DIM=128, DIM_PAD=128, PAGE=16, BLOCK_N=64, SPLITS_PAD=16,
    MERGE_CHUNK=16, EARLY_LOADS=False, SOFT_CAP=False, WINDOW=False, F32_DOT=False, NEW_KV=True,
    ROTARY=True, HALF=64, IS_NEOX=True, PREFETCH=2, LINES=2, LINE=64, qw_ptr=None, kw_ptr=None,
    QK_NORM=False, QK_EPS=0.0, clock_ptr=None, CLOCK=False, epoch_ptr=None, SPREAD=False,
    SLICE=1,
)
# and with Qwen3's per-head q / k norm before the rotary (the weights are real pointers then)
_SPLITKV_QK = {k: v for k, v in _SPLITKV.items() if k not in ("qw_ptr", "kw_ptr")}
_SPLITKV_QK.update(QK_NORM=True, QK_EPS=1e-6)
_GATE_UP = dict(INTER=64, HIDDEN=256, TOP_K=2, BLOCK_N=8, BLOCK_K=128, NUM_STAGES=3)
_DOWN = dict(INTER=256, HIDDEN=256, TOP_K=2, K_STEPS=2, BLOCK_N=8, BLOCK_K=128, NUM_STAGES=4)
CASES = {  # name: (module, kernel, constexprs)
    "gemv off": ("fused_gemv_kernel", "_fused_gemv_kernel", {**_GEMV, "USE_PDL": pdl.OFF}),
    "norm+gemv early": ("fused_gemv_kernel", "_fused_gemv_kernel", {**_GEMV, "USE_PDL": pdl.EARLY}),
    "norm+gemv late": ("fused_gemv_kernel", "_fused_gemv_kernel", {**_GEMV, "USE_PDL": pdl.LATE}),
    # weight tiles through a TMA descriptor, pipelined (four tiles, num_stages 3)
    "norm+gemv late tma": (
        "fused_gemv_kernel", "_fused_gemv_kernel",
        {**_GEMV, "USE_PDL": pdl.LATE, "TMA": True, "NUM_STAGES": 3},
    ),
    "gemv off tma": (
        "fused_gemv_kernel", "_fused_gemv_kernel",
        {**_GEMV, "USE_PDL": pdl.OFF, "TMA": True, "NUM_STAGES": 3},
    ),
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
    "splitkv off": (
        "splitkv_decode", "_splitkv_decode_kernel", {**_SPLITKV, "USE_PDL": pdl.OFF}
    ),
    "splitkv early": (
        "splitkv_decode", "_splitkv_decode_kernel", {**_SPLITKV, "USE_PDL": pdl.EARLY}
    ),
    "splitkv late": (
        "splitkv_decode", "_splitkv_decode_kernel", {**_SPLITKV, "USE_PDL": pdl.LATE}
    ),
    "splitkv late qk_norm": (
        "splitkv_decode", "_splitkv_decode_kernel", {**_SPLITKV_QK, "USE_PDL": pdl.LATE}
    ),
    "splitkv early qk_norm": (
        "splitkv_decode", "_splitkv_decode_kernel", {**_SPLITKV_QK, "USE_PDL": pdl.EARLY}
    ),
    # the merge spread over the pair's 16 programs (a 32-output slice each), the epoch a pointer
    "splitkv early spread": (
        "splitkv_decode", "_splitkv_decode_kernel",
        {**{k: v for k, v in _SPLITKV.items() if k != "epoch_ptr"}, "USE_PDL": pdl.EARLY,
         "SPREAD": True, "SLICE": 32},
    ),
    # the benchmark-only phase clock (kernels/phase_clock.py), a pointer then
    "splitkv early clock": (
        "splitkv_decode", "_splitkv_decode_kernel",
        {**{k: v for k, v in _SPLITKV.items() if k != "clock_ptr"}, "USE_PDL": pdl.EARLY,
         "CLOCK": True},
    ),
    "gate_up off": ("moe_small", "_gate_up_kernel", {**_GATE_UP, "USE_PDL": pdl.OFF}),
    "gate_up late": ("moe_small", "_gate_up_kernel", {**_GATE_UP, "USE_PDL": pdl.LATE}),
    "down off": ("moe_small", "_down_combine_kernel", {**_DOWN, "USE_PDL": pdl.OFF}),
    "down early": ("moe_small", "_down_combine_kernel", {**_DOWN, "USE_PDL": pdl.EARLY}),
    "down late": ("moe_small", "_down_combine_kernel", {**_DOWN, "USE_PDL": pdl.LATE}),
    "router": (
        "moe_router",
        "_norm_route_kernel",
        dict(HIDDEN=256, E=16, K=2, NUM_BLOCKS=8, BLOCK_H=256, BLOCK_R=2, BLOCK_E=16, BLOCK_K=2,
             RENORMALIZE=True, USE_PDL=1, clock_ptr=None, CLOCK=False),
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
            elif arg == "w_ptr" and constexprs.get("TMA"):
                block = (constexprs["BLOCK_N"], constexprs["BLOCK_K"])
                signature[arg] = f"tensordesc<bf16[{block[0]}, {block[1]}]>"
            elif arg.endswith("_ptr"):
                signature[arg] = _POINTERS.get(arg, "*bf16")
            else:
                signature[arg] = "fp32" if arg in _FLOATS else "i32"
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        options = {"num_stages": constexprs.get("NUM_STAGES", 3)}
        out[case] = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options=options
        ).asm["ptx"]
    return out


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    return compiled_in_child(__file__)


@pytest.mark.parametrize(
    "case",
    ["norm+gemv early", "norm+gemv late", "norm+gemv late tma", "rotary_kv", "add_rms_norm",
     "qk_norm", "router", "splitkv early", "splitkv late", "splitkv late qk_norm",
     "splitkv early qk_norm", "splitkv early spread", "gate_up late", "down early", "down late"],
)
def test_a_pdl_kernel_waits_once_and_writes_nothing_before_its_wait(ptx, case) -> None:
    code = ptx[case]
    assert code.count("griddepcontrol.wait") == 1
    assert code.count("griddepcontrol.launch_dependents") == 1
    before_wait = code.split("griddepcontrol.wait")[0]
    # a bulk copy into global memory is a write; one into shared memory (a TMA load of a
    # weight tile, ``.shared::cluster.global``) is not
    bulk_writes = re.findall(r"cp\.(?:reduce\.)?async\.bulk[\w:.]*\.global\.shared", before_wait)
    assert not bulk_writes, f"{case}: {bulk_writes} before the wait"
    for write in ("st.global", "atom.", "red."):  # as instructions (".shared." holds "red.")
        found = re.findall(rf"^\s*(?:@!?%p\d+\s+)?{re.escape(write)}", before_wait, re.M)
        assert not found, f"{case}: {write} before the wait"
    if "late" in case and ("gemv" in case or case.startswith(("gate_up", "down"))):
        # the trigger after the weight loop's last load (plain or asynchronous)
        after_wait = code.split("griddepcontrol.wait")[1]
        trigger = after_wait.index("griddepcontrol.launch_dependents")
        assert trigger > after_wait.rfind("ld.global")
        assert trigger > after_wait.rfind("cp.async.wait_group")


def test_the_plain_kernel_has_no_pdl_instruction(ptx) -> None:
    assert "griddepcontrol" not in ptx["gemv off"]
    assert "griddepcontrol" not in ptx["gemv off tma"]
    assert "griddepcontrol" not in ptx["splitkv off"]
    assert "prefetch.global.L2" not in ptx["splitkv off"]
    for case in ("gate_up off", "down off"):
        assert "griddepcontrol" not in ptx[case] and "prefetch.global.L2" not in ptx[case]


def test_the_clocked_build_stamps_the_timer_and_the_sm_and_the_plain_one_neither(ptx) -> None:
    """The phase clock's build reads ``%globaltimer`` at its marks and ``%smid`` once; the
    build without it (every other split-KV case) reads neither."""
    clocked = ptx["splitkv early clock"]
    assert clocked.count("%globaltimer") >= 7 and clocked.count("%smid") == 1
    assert "%globaltimer" not in ptx["splitkv early"] and "%smid" not in ptx["splitkv early"]


def test_the_expert_kernels_load_nothing_before_their_wait(ptx) -> None:
    """Their weights depend on the routing, which the router right ahead writes (gate-up) or
    which gate-up's output pairs with (down): both wait first, then load; the early trigger comes
    before the first load, the late one after the last (checked above)."""
    for case in ("gate_up late", "down early", "down late"):
        before = ptx[case].split("griddepcontrol.wait")[0]
        assert "ld.global" not in before and "cp.async" not in before, case
    early = ptx["down early"].split("griddepcontrol.wait")[1]
    assert early.index("griddepcontrol.launch_dependents") < early.index("ld.global")


@pytest.mark.parametrize(
    "case", ["splitkv early", "splitkv late", "splitkv late qk_norm", "splitkv early qk_norm"]
)
def test_splitkv_asks_l2_for_its_tiles_before_the_wait_and_reads_q_after(ptx, case) -> None:
    """Before its wait the split-KV launch prefetches K and V (two tiles: one prefetch per L2
    line a thread holds, kept although its result is unused) and loads metadata only; q and the
    new token, which the kernel ahead writes, are loaded after it."""
    before, after = ptx[case].split("griddepcontrol.wait")
    assert before.count("prefetch.global.L2") >= 4  # K and V of two tiles
    assert "prefetch.global.L2" not in after
    assert "ld.global" in before  # kv_len, page ids, the rotary row
    trigger = after.index("griddepcontrol.launch_dependents")
    if "late" in case:  # after the tile loop's K/V loads, before the splits' arrival
        assert trigger > after.rfind("cp.async.wait_group")
        assert trigger < after.index("atom.")
    else:
        assert trigger < after.index("ld.global")


def test_the_fused_qk_norm_loads_its_weights_before_the_wait_and_q_k_after(ptx) -> None:
    """With the q / k norm in the launch, its two weights (and their values at each dim's
    rotary partner) are loaded before the wait: parameters the projection ahead does not write
    (rule 1); q and the new key stay after it. The norm's reductions come after the wait."""
    plain_before = ptx["splitkv late"].split("griddepcontrol.wait")[0]
    before, after = ptx["splitkv late qk_norm"].split("griddepcontrol.wait")
    assert before.count("ld.global") >= plain_before.count("ld.global") + 4
    sqrt = re.compile(r"^\s*(?:@!?%p\d+\s+)?sqrt\.", re.M)  # the instruction, not a label
    assert not sqrt.search(before) and sqrt.search(after)
    assert not sqrt.search(ptx["splitkv late"])


def test_tma_weight_tiles_are_pipelined_and_the_first_is_asked_before_the_wait(ptx) -> None:
    """The descriptor's tiles are bulk copies into shared memory, several in flight (the
    pipeliner's prologue; plain weight loads have none), the peeled first one before the wait
    (weights only, rule 1); x is read after it, as in the plain kernel."""
    plain = ptx["gemv off"]
    assert "cp.async.bulk.tensor" not in plain
    copies = ptx["gemv off tma"].count("cp.async.bulk.tensor")
    assert copies >= 3, copies  # the first tile, the pipeliner's prologue and the loop's
    before, after = ptx["norm+gemv late tma"].split("griddepcontrol.wait")
    assert "cp.async.bulk.tensor" in before and "cp.async.bulk.tensor" in after
    assert "mbarrier.try_wait" in after


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
