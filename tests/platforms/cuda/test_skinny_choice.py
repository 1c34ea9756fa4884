"""The skinny GEMM against cuBLAS, chosen by timing (``platforms/cuda/skinny_choice.py``), off
the GPU with fake timings: the faster by the margin wins, the answer is kept on disk and read back
without timing, ``XHAL_AUTOTUNE=0`` never times, and ``CudaOps.linear`` sends a captured
projection where its warm-up's choice said. The timings themselves run on the GPU
(``scripts/gpu_run.sh skinny``)."""

from __future__ import annotations

import pytest
import torch

from tests.platforms.cuda.test_native_kernels import H100_SHARED
from xhal.platforms.cuda import skinny_choice
from xhal.platforms.cuda.kernels import skinny_mma
from xhal.solutions.solution import DeviceInfo
from xhal.solutions.tuning_cache import TuningCache

DEVICE = DeviceInfo("cuda", name="fake H100", library_versions=(("torch", "0"),))


def skinny(w):
    return "skinny"


def cublas(w):
    return "cublas"


class FakeTimer:
    """Seconds a call by which callable it is; counts the timings."""

    def __init__(self, skinny_s: float, cublas_s: float) -> None:
        self.times = {skinny: skinny_s, cublas: cublas_s}
        self.calls = 0

    def __call__(self, call, weight) -> float:
        self.calls += 1
        return self.times[call]


def choose(tmp_path, timer, name="m16-n4096-k4096") -> bool:
    choice = skinny_choice.SkinnyChoice(TuningCache(DEVICE, tmp_path), timer)
    return choice.prefers_skinny(name, skinny, cublas, torch.empty(1))


@pytest.mark.parametrize(
    ("skinny_us", "wins"),
    [(9.0, True), (9.79, True), (9.81, False), (10.0, False), (12.0, False)],
)
def test_the_skinny_gemm_must_beat_cublas_by_the_margin(tmp_path, skinny_us, wins) -> None:
    # cuBLAS at 10 us: the skinny GEMM is chosen under 9.8 (MARGIN 2%)
    assert skinny_choice.MARGIN == 0.02
    assert choose(tmp_path, FakeTimer(skinny_us * 1e-6, 10e-6)) is wins


def test_a_choice_is_kept_on_disk_and_read_back_without_timing(tmp_path) -> None:
    first = FakeTimer(5e-6, 10e-6)
    assert choose(tmp_path, first) is True
    assert first.calls == 2
    again = FakeTimer(50e-6, 10e-6)  # a second start: the disk answers, nothing is timed
    assert choose(tmp_path, again) is True
    assert again.calls == 0
    other = FakeTimer(50e-6, 10e-6)  # another shape is timed afresh
    assert choose(tmp_path, other, name="m64-n4096-k4096") is False
    assert other.calls == 2


def test_with_autotune_off_an_unknown_shape_takes_cublas_and_a_known_one_its_winner(
    tmp_path, monkeypatch
) -> None:
    choose(tmp_path, FakeTimer(5e-6, 10e-6), name="known")
    monkeypatch.setenv("XHAL_AUTOTUNE", "0")
    timer = FakeTimer(5e-6, 10e-6)
    assert choose(tmp_path, timer, name="unknown") is False
    assert choose(tmp_path, timer, name="known") is True
    assert timer.calls == 0


def test_no_memory_for_the_weight_copies_takes_cublas_for_this_process_only(tmp_path) -> None:
    def out_of_memory(call, weight):
        raise torch.OutOfMemoryError("CUDA out of memory")

    assert choose(tmp_path, out_of_memory) is False
    assert TuningCache(DEVICE, tmp_path).get(skinny_choice.SOLUTION_KEY, "m16-n4096-k4096") is None


def test_a_read_only_cache_costs_a_log_line_not_the_choice(tmp_path, monkeypatch, caplog) -> None:
    def refuse(*args):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(TuningCache, "put", refuse)
    with caplog.at_level("WARNING"):
        assert choose(tmp_path, FakeTimer(5e-6, 10e-6)) is True
    assert "XHAL_CACHE_DIR" in caplog.text


def test_the_bucket_names_the_shape_the_dtype_the_plan_and_the_source() -> None:
    a = skinny_mma.plan(16, 4096, 4096, 132, H100_SHARED)
    b = skinny_mma.plan(64, 4096, 4096, 132, H100_SHARED)
    name = skinny_choice.bucket(16, 4096, 4096, torch.bfloat16, a)
    assert name.startswith("m16-n4096-k4096-bfloat16-plan")
    assert name != skinny_choice.bucket(16, 4096, 4096, torch.float16, a)
    assert name != skinny_choice.bucket(16, 4096, 4096, torch.bfloat16, b)
    assert name.endswith(f"-src{skinny_choice._source_digest()}")


class FakeKernels:
    """A SkinnyMma stand-in: its product, marked by a count of launches."""

    def __init__(self) -> None:
        self.launches = 0

    def plan(self, m, n, k):
        return skinny_mma.plan(m, n, k, 132, H100_SHARED)

    def __call__(self, x, weight, use_pdl, p):
        self.launches += 1
        return x @ weight.T


def fake_ops(monkeypatch, tmp_path, timer):
    from xhal.platforms.cuda.ops import CudaOps

    capturing = {"now": False}
    monkeypatch.setattr(skinny_mma, "supports", lambda x, w: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    ops = CudaOps()
    kernels = FakeKernels()
    monkeypatch.setattr(ops, "_native", lambda device, family: kernels)

    def counting_timer(call, weight):  # which of the two ran: the fake kernel counts its launches
        before = kernels.launches
        call(weight)
        return timer[0] if kernels.launches > before else timer[1]

    ops._skinny_choice = skinny_choice.SkinnyChoice(TuningCache(DEVICE, tmp_path), counting_timer)
    return ops, kernels, capturing


@pytest.mark.parametrize("skinny_wins", [True, False])
def test_auto_captures_what_the_warm_up_chose(monkeypatch, tmp_path, skinny_wins) -> None:
    monkeypatch.delenv("XHAL_CUDA_SKINNY_MMA", raising=False)
    timer = (5e-6, 10e-6) if skinny_wins else (10e-6, 5e-6)
    ops, kernels, capturing = fake_ops(monkeypatch, tmp_path, timer)
    x, w = torch.randn(16, 64), torch.randn(32, 64)
    # the warm-up times the kernel once, then runs the winner (building it if it is the kernel)
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)
    assert kernels.launches == 1 + skinny_wins
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)  # later eager calls: cuBLAS, untimed
    assert kernels.launches == 1 + skinny_wins
    capturing["now"] = True
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)
    assert kernels.launches == 1 + 2 * skinny_wins


def test_auto_captures_cublas_for_a_shape_no_warm_up_timed(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("XHAL_CUDA_SKINNY_MMA", raising=False)
    ops, kernels, capturing = fake_ops(monkeypatch, tmp_path, (5e-6, 10e-6))
    capturing["now"] = True
    x, w = torch.randn(16, 64), torch.randn(32, 64)
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)
    assert kernels.launches == 0


@pytest.mark.parametrize(("setting", "launches"), [("1", 1), ("0", 0)])
def test_forced_settings_never_time(monkeypatch, tmp_path, setting, launches) -> None:
    monkeypatch.setenv("XHAL_CUDA_SKINNY_MMA", setting)
    ops, kernels, capturing = fake_ops(monkeypatch, tmp_path, (10e-6, 5e-6))  # cuBLAS faster
    x, w = torch.randn(16, 64), torch.randn(32, 64)
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)
    assert kernels.launches == launches  # "1" launches without timing, "0" never
    assert ops._skinny_choice.chosen == {}
