"""Solutions as data: the registry, selection of the best solution a device meets (a missing
package skipped with one log line), ``XHAL_KERNEL_<OP>`` and platform-forced choices, the choice
logged once, the entry-point group, and the ops and attention built from the choices."""

from __future__ import annotations

import importlib.util
import logging
import random
import subprocess
import sys

import pytest
import torch

import xhal
from conformance_tests.batches import random_batch, random_caches, random_qkv
from tests.support import toy_solutions as toy
from tests.support.paths import REPO
from xhal import solutions
from xhal.interfaces import AttentionSpec, BatchKind
from xhal.solutions import registry
from xhal.solutions.kernels import Kernels
from xhal.solutions.split_attention import SplitAttention


@pytest.fixture
def toys():
    yield from toy.registered(toy.toy_solutions())


def test_every_op_has_a_cpu_reference_and_declarations_import_no_kernel_library() -> None:
    for op in solutions.OPS:
        assert any(s.name == "reference" for s in solutions.solutions(op, "cpu")), op
    cuda = {s.key for op in solutions.OPS for s in solutions.solutions(op, "cuda")}
    assert {"linear=triton", "rms_norm=flashinfer", "paged_decode_attention=flashinfer",
            "paged_prefill_attention=triton", "moe_experts=triton-grouped"} <= cuda
    # in a fresh interpreter: other tests of this process may have imported kernels
    probe = (
        "import sys\nfrom xhal import solutions\n"
        "assert sum(len(solutions.solutions(op)) for op in solutions.OPS) > 30\n"
        "print(sorted({'triton', 'flashinfer', 'tilelang', 'xhal.platforms.cuda.ops', "
        "'xhal.platforms.npu.ops'} & set(sys.modules)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_best_met_solution_wins_and_a_missing_package_is_logged_once(toys, caplog) -> None:
    from xhal.solutions import selection as select_module

    select_module._missing_logged.discard(toy.MISSING.module)
    with caplog.at_level(logging.WARNING, logger="xhal.solutions"):
        first = solutions.select("rms_norm", toy.DEVICE)
        again = solutions.select("rms_norm", toy.DEVICE)
    # needs-pkg (30) lacks its package, newer-device (20) needs compute capability 9.0
    assert first.name == again.name == "torch"
    lines = [r.getMessage() for r in caplog.records if toy.MISSING.module in r.getMessage()]
    assert len(lines) == 1 and toy.MISSING.install in lines[0], lines
    newer = toy.DEVICE.__class__("toy", compute_capability=(9, 0))
    assert solutions.select("rms_norm", newer).name == "newer-device"


def test_unmet_gives_the_reason() -> None:
    triton_attention = next(
        s for s in solutions.solutions("paged_decode_attention", "cuda") if s.name == "flashinfer"
    )
    h200 = solutions.DeviceInfo("cuda", "H200", (9, 0))
    assert "takes float16, bfloat16, not float32" in solutions.unmet(
        triton_attention, h200, dtype=torch.float32
    )
    cpu = solutions.DeviceInfo("cpu")
    assert solutions.unmet(triton_attention, cpu) == "needs a cuda device, this is cpu"


def test_forced_solution_never_falls_back(toys) -> None:
    assert solutions.select("rms_norm", toy.DEVICE, forced="reference").name == "reference"
    with pytest.raises(
        solutions.SolutionUnavailable, match="xhal_toy_missing_pkg is not installed"
    ):
        solutions.select("rms_norm", toy.DEVICE, forced="needs-pkg")
    with pytest.raises(KeyError, match="known: needs-pkg, newer-device, torch, reference"):
        solutions.select("rms_norm", toy.DEVICE, forced="nope")


def test_kernels_choose_once_log_one_line_and_serve_the_choice(toys, caplog, monkeypatch) -> None:
    with caplog.at_level(logging.INFO, logger="xhal.solutions"):
        kernels = Kernels(toy.ToyPlatform(), toy.DEVICE)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels of toy")]
    assert len(lines) == 1 and "rms_norm=torch" in lines[0] and "linear=reference" in lines[0], (
        lines
    )
    assert kernels.ops.names["rms_norm"] == "torch"
    x, w = torch.randn(3, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 0.5) * w
    torch.testing.assert_close(
        kernels.ops.rms_norm(x.float(), w.float(), 0.5).double(), expected, rtol=1e-6, atol=1e-6
    )
    # the environment forces another, and the platform's defaults yield to it
    monkeypatch.setenv("XHAL_KERNEL_RMS_NORM", "reference")
    assert (
        Kernels(toy.ToyPlatform(), toy.DEVICE, defaults={"rms_norm": "torch"}).ops.names["rms_norm"]
        == "reference"
    )


def test_overrides_bad_names_raise_and_other_devices_names_are_left_alone(
    toys, monkeypatch
) -> None:
    monkeypatch.setenv("XHAL_KERNEL_RMS_NROM", "torch")
    with pytest.raises(
        ValueError, match="XHAL_KERNEL_RMS_NROM: no such op; settings: .*XHAL_KERNEL_RMS_NORM"
    ):
        Kernels(toy.ToyPlatform(), toy.DEVICE)
    monkeypatch.delenv("XHAL_KERNEL_RMS_NROM")
    monkeypatch.setenv("XHAL_KERNEL_RMS_NORM", "no-such-solution")
    with pytest.raises(
        ValueError, match="rms_norm has no solution 'no-such-solution'; known: .*flashinfer"
    ):
        Kernels(toy.ToyPlatform(), toy.DEVICE)
    # a CUDA-only name (a CUDA server also creates the CPU platform): left to the CUDA platform
    monkeypatch.setenv("XHAL_KERNEL_RMS_NORM", "flashinfer")
    assert Kernels(toy.ToyPlatform(), toy.DEVICE).ops.names["rms_norm"] == "torch"
    monkeypatch.setenv("XHAL_KERNEL_RMS_NORM", "needs-pkg")
    with pytest.raises(solutions.SolutionUnavailable, match="forced but cannot run here"):
        Kernels(toy.ToyPlatform(), toy.DEVICE)


def test_ops_with_swaps_one_op_only(toys) -> None:
    kernels = Kernels(toy.ToyPlatform(), toy.DEVICE)
    swapped = kernels.ops_with("rms_norm", "reference")
    assert swapped.names == {**kernels.ops.names, "rms_norm": "reference"}
    assert kernels.ops.names["rms_norm"] == "torch"


def test_different_decode_and_prefill_solutions_split_attention_by_step_kind(toys) -> None:
    kernels = Kernels(toy.ToyPlatform(), toy.DEVICE)
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=16
    )
    backend = kernels.attention_backend(spec)
    assert isinstance(backend, SplitAttention)
    with (
        kernels.forcing("paged_decode_attention", "reference"),
        kernels.forcing("paged_prefill_attention", "reference"),
    ):
        reference = kernels.attention_backend(spec)
    assert not isinstance(reference, SplitAttention)
    cpu = torch.device("cpu")
    for kind in (BatchKind.PREFILL, BatchKind.DECODE, BatchKind.MIXED):
        batch, num_blocks = random_batch(kind, spec.block_size, cpu, random.Random(int(kind)))
        outs = []
        for b in (backend, reference):
            b.bind_kv_caches(random_caches(1, num_blocks, spec, cpu, random.Random(7)))
            toy.RecordingAttention.plans.clear()
            b.plan(batch.metadata)
            q, k, v = random_qkv(batch.metadata.num_tokens, spec, cpu, random.Random(8))
            outs.append(b.forward(0, q, k, v))
            if b is backend:
                assert toy.RecordingAttention.plans == [
                    "decode" if kind == BatchKind.DECODE else "prefill"
                ]
        torch.testing.assert_close(outs[0], outs[1])


def test_entry_point_group_adds_solutions(monkeypatch) -> None:
    import importlib.metadata

    class FakeEntryPoint:
        name, value = "toy", "tests.support.toy_solutions:toy_solutions"

        @staticmethod
        def load():
            return toy.toy_solutions

    def entry_points(group: str):
        return [FakeEntryPoint] if group == solutions.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_by_op", {op: [] for op in solutions.OPS})
    names = [s.name for s in solutions.solutions("rms_norm", "toy")]
    assert names == ["needs-pkg", "newer-device", "torch", "reference"]
    assert any(
        s.name == "reference" for s in solutions.solutions("rms_norm", "cpu")
    )  # built-ins too


def test_cpu_platform_serves_its_chosen_solutions() -> None:
    platform = xhal.platforms.get("cpu")
    assert platform.kernels is not None and platform.ops is platform.kernels.ops
    assert set(platform.ops.names.values()) == {"reference"}


def test_a_row_limited_solution_hands_larger_calls_to_the_next_best(toys) -> None:
    small = solutions.Solution(
        "silu_and_mul",
        "two-rows",
        "tests.support.toy_solutions:CountingActivation",
        solutions.Requirement(device_type="toy", max_rows=2),
        priority=50,
    )
    for _ in toy.registered([small]):
        kernels = Kernels(toy.ToyPlatform(), toy.DEVICE)
        assert kernels.ops.names["silu_and_mul"] == "two-rows"
        g = torch.Generator().manual_seed(0)
        for shape, expected_calls in (((2, 8), 1), ((3, 8), 0), ((1, 2, 8), 1), ((2, 2, 8), 0)):
            # float32: both solutions compute the activation in float32, as the reference
            # does (float64 inputs would be held to float64's tolerance and fail at random)
            x = torch.randn(*shape, generator=g)
            toy.CountingActivation.calls = 0
            gate, up = x.chunk(2, dim=-1)
            torch.testing.assert_close(
                kernels.ops.silu_and_mul(x), torch.nn.functional.silu(gate) * up
            )
            assert toy.CountingActivation.calls == expected_calls, shape


def test_a_fused_op_left_at_its_default_runs_the_chosen_ops(toys) -> None:
    """A fused op whose only solution is a provider's inherited ``DeviceOps`` default (the CPU
    reference's) is the plain sequence of the platform's chosen ops, not of that provider's: a
    platform that chose a faster ``silu_and_mul`` gets it inside ``silu_and_mul_linear`` and the
    gated MLP block too, with the reference's values."""
    fast = solutions.Solution(
        "silu_and_mul",
        "counting",
        "tests.support.toy_solutions:CountingActivation",
        solutions.Requirement(device_type="toy"),
        priority=50,
    )
    for _ in toy.registered([fast]):
        ops = Kernels(toy.ToyPlatform(), toy.DEVICE).ops
        assert ops.names["silu_and_mul_linear"] == "reference"
        assert "silu_and_mul_linear" not in ops.impls
        reference = xhal.platforms.get("cpu").ops
        g = torch.Generator().manual_seed(0)
        x, residual, norm_w = (torch.randn(3, 16, generator=g, dtype=torch.float64) for _ in "abc")
        w_gu = torch.randn(24, 16, generator=g, dtype=torch.float64)
        w_down = torch.randn(16, 12, generator=g, dtype=torch.float64)
        gate_up = torch.randn(3, 24, generator=g, dtype=torch.float64)  # [T, 2I]
        toy.CountingActivation.calls = 0
        got = ops.silu_and_mul_linear(gate_up, w_down)
        assert toy.CountingActivation.calls == 1
        torch.testing.assert_close(got, reference.silu_and_mul_linear(gate_up, w_down))
        toy.CountingActivation.calls = 0
        out, summed = ops.add_rms_norm_gated_mlp(x, residual, norm_w, 1e-6, w_gu, w_down)
        assert toy.CountingActivation.calls == 1
        want, want_summed = reference.add_rms_norm_gated_mlp(
            x, residual, norm_w, 1e-6, w_gu, w_down
        )
        torch.testing.assert_close(out, want)
        assert torch.equal(summed, want_summed)


# scripts/check_solutions.py checks on the GPU what each CUDA platform chooses against the
# choices made by hand before solutions (FlashInfer installed); its table is read here to check
# the declarations on any machine. scripts/ is a folder of scripts, not a package: load by path.
_spec = importlib.util.spec_from_file_location(
    "check_solutions", REPO / "scripts" / "check_solutions.py"
)
check_solutions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_solutions)


def _device_ops(choices: dict[str, str]) -> dict[str, str]:
    """The device ops of a legacy table (its attention rows are checked per op below)."""
    return {op: name for op, name in choices.items() if not op.startswith("attention ")}


LEGACY_CUDA = _device_ops(check_solutions.LEGACY["cuda"])


@pytest.mark.parametrize(
    "installed", [{"triton", "flashinfer"}, {"triton"}], ids=["flashinfer", "no-flashinfer"]
)
def test_cuda_declarations_keep_the_choices_made_before_solutions(installed, monkeypatch) -> None:
    from xhal.platforms.cuda.platform import CudaTritonPlatform
    from xhal.solutions import selection

    monkeypatch.setattr(selection, "_importable", lambda module: module in installed)
    h200 = solutions.DeviceInfo("cuda", "NVIDIA H200", (9, 0))
    expected = LEGACY_CUDA if "flashinfer" in installed else {**LEGACY_CUDA, "rms_norm": "torch"}
    assert {op: solutions.select(op, h200).name for op in LEGACY_CUDA} == expected
    for dtype, name in (
        (torch.bfloat16, "flashinfer"),
        (torch.float16, "flashinfer"),
        (torch.float32, "triton"),
    ):
        for op in solutions.ATTENTION_OPS:
            got = solutions.select(op, h200, dtype=dtype, head_dim=128).name
            want = name if "flashinfer" in installed else "triton"
            if op == "paged_decode_attention" and want == "flashinfer":
                # the one new default since: small decode buckets on the split-KV Triton
                # kernel, FlashInfer's decode for the rest (XHAL_KERNEL_...=flashinfer: all)
                want = "triton-splitkv"
            assert got == want, (op, dtype)
    # cuda-triton: Triton attention and torch norms and activations, whatever is installed
    forced = CudaTritonPlatform.solution_defaults
    assert {
        op: solutions.select(op, h200, forced=forced.get(op)).name for op in LEGACY_CUDA
    } == _device_ops(check_solutions.LEGACY["cuda-triton"])
    assert {
        solutions.select(op, h200, forced=forced[op], dtype=torch.bfloat16).name
        for op in solutions.ATTENTION_OPS
    } == {"triton"}


def test_split_attention_fuses_rotary_only_when_both_sides_do() -> None:
    """The layer asks ``fuses_rotary`` once for every step kind, so the split backend declares
    it only when decode and prefill both fuse, and sends ``forward_rotary`` to the side the
    step was planned on."""
    from xhal.interfaces.attention import AttentionBackend

    class Fusing(AttentionBackend):
        def __init__(self, spec, fuses: bool) -> None:
            super().__init__(spec)
            self.fuses_rotary, self.calls = fuses, []

        def bind_kv_caches(self, caches) -> None:
            pass

        def plan(self, metadata, graph_key=None) -> None:
            pass

        def forward(self, layer_id, q, k, v):
            raise AssertionError("the rotary path was expected")

        def forward_rotary(self, layer_id, q, k, v, positions, cos_sin_cache, is_neox):
            self.calls.append(layer_id)
            return q

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                         block_size=16)  # fmt: skip
    assert not SplitAttention(spec, Fusing(spec, True), Fusing(spec, False)).fuses_rotary
    decode, prefill = Fusing(spec, True), Fusing(spec, True)
    split = SplitAttention(spec, decode, prefill)
    assert split.fuses_rotary
    cpu = torch.device("cpu")
    for kind, layer in ((BatchKind.DECODE, 3), (BatchKind.PREFILL, 5)):
        batch, _ = random_batch(kind, spec.block_size, cpu, random.Random(int(kind)))
        split.plan(batch.metadata)
        q = torch.zeros(batch.metadata.num_tokens, 4, 16)
        split.forward_rotary(layer, q, q[:, :2], q[:, :2], None, None, True)
    assert (decode.calls, prefill.calls) == ([3], [5])


def test_the_o_route_defaults_to_the_sequence_of_chosen_ops() -> None:
    """``linear_add_rms_norm_moe_route`` on CUDA: ``unfused`` is chosen, and its provider only
    inherits the op's default, so the platform runs the chosen linear and router (forcing
    ``XHAL_KERNEL_LINEAR`` still reaches a MoE layer's o); ``native`` is forced by name."""
    from xhal.platforms.cuda.o_route_ops import NativeORouteOps
    from xhal.platforms.cuda.ops import CudaOps
    from xhal.solutions.kernels import inherits_default

    h200 = solutions.DeviceInfo("cuda", "NVIDIA H200", (9, 0))
    op = "linear_add_rms_norm_moe_route"
    assert solutions.select(op, h200).name == "unfused"
    assert solutions.select(op, h200, forced="native").name == "native"
    assert inherits_default(CudaOps().linear_add_rms_norm_moe_route, op)
    assert not inherits_default(NativeORouteOps().linear_add_rms_norm_moe_route, op)
