"""The skinny GEMM's launch shapes against cuBLAS, chosen by timing
(``platforms/cuda/skinny_choice.py``), off the GPU with fake timings: the fastest shape wins if it
beats cuBLAS by the margin, the answer is kept on disk and read back without timing,
``XHAL_AUTOTUNE=0`` never times, and ``CudaOps.linear`` sends a captured projection where its
warm-up's choice said. The timings themselves run on the GPU
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


def call(label: str):
    def run(w):
        return label

    return run


class FakeTimer:
    """Seconds a call by the label it returns; counts the timings."""

    def __init__(self, **us: float) -> None:
        self.us, self.calls = us, 0

    def __call__(self, run, weight) -> float:
        self.calls += 1
        return self.us[run(weight)] * 1e-6


def choose(tmp_path, timer, name="m16-n4096-k4096", labels=("plan", "ks2")) -> str:
    choice = skinny_choice.SkinnyChoice(TuningCache(DEVICE, tmp_path), timer)
    shapes = {label: call(label) for label in labels}
    return choice.choose(name, shapes, call(skinny_choice.CUBLAS), torch.empty(1))


@pytest.mark.parametrize(
    ("plan_us", "ks2_us", "winner"),
    [
        (9.0, 9.5, "plan"),
        (9.5, 9.0, "ks2"),  # the fastest shape, not the plan
        (9.79, 12.0, "plan"),
        (9.81, 12.0, "cublas"),  # under the 2% margin: the library
        (12.0, 10.0, "cublas"),
    ],
)
def test_the_fastest_shape_wins_if_it_beats_cublas_by_the_margin(
    tmp_path, plan_us, ks2_us, winner
) -> None:
    assert skinny_choice.MARGIN == 0.02
    assert choose(tmp_path, FakeTimer(plan=plan_us, ks2=ks2_us, cublas=10.0)) == winner


def test_a_choice_is_kept_on_disk_and_read_back_without_timing(tmp_path) -> None:
    first = FakeTimer(plan=5.0, ks2=7.0, cublas=10.0)
    assert choose(tmp_path, first) == "plan"
    assert first.calls == 3
    again = FakeTimer(plan=50.0, ks2=50.0, cublas=10.0)  # a second start: the disk answers
    assert choose(tmp_path, again) == "plan"
    assert again.calls == 0
    assert choose(tmp_path, again, name="m64-n4096-k4096") == "cublas"  # another shape: timed
    assert again.calls == 3
    # a planner that no longer offers the cached winner: timed afresh
    again.us["other"] = 5.0
    assert choose(tmp_path, again, labels=("other",)) == "other"
    assert again.calls == 5


def test_with_autotune_off_an_unknown_shape_takes_cublas_and_a_known_one_its_winner(
    tmp_path, monkeypatch
) -> None:
    choose(tmp_path, FakeTimer(plan=5.0, ks2=7.0, cublas=10.0), name="known")
    monkeypatch.setenv("XHAL_AUTOTUNE", "0")
    timer = FakeTimer(plan=5.0, ks2=7.0, cublas=10.0)
    assert choose(tmp_path, timer, name="unknown") == "cublas"
    assert choose(tmp_path, timer, name="known") == "plan"
    assert timer.calls == 0


def test_no_memory_for_the_weight_copies_takes_cublas_for_this_process_only(tmp_path) -> None:
    def out_of_memory(run, weight):
        raise torch.OutOfMemoryError("CUDA out of memory")

    assert choose(tmp_path, out_of_memory) == "cublas"
    assert TuningCache(DEVICE, tmp_path).get(skinny_choice.SOLUTION_KEY, "m16-n4096-k4096") is None


def test_a_read_only_cache_costs_a_log_line_not_the_choice(tmp_path, monkeypatch, caplog) -> None:
    def refuse(*args):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(TuningCache, "put", refuse)
    with caplog.at_level("WARNING"):
        assert choose(tmp_path, FakeTimer(plan=5.0, ks2=7.0, cublas=10.0)) == "plan"
    assert "XHAL_CACHE_DIR" in caplog.text


def test_the_bucket_names_the_shape_the_dtype_and_the_source() -> None:
    name = skinny_choice.bucket(16, 4096, 4096, torch.bfloat16)
    assert name == f"m16-n4096-k4096-bfloat16-src{skinny_choice._source_digest()}"
    assert name != skinny_choice.bucket(16, 4096, 4096, torch.float16)
    assert name != skinny_choice.bucket(32, 4096, 4096, torch.bfloat16)


def test_the_shapes_timed_are_the_plan_and_the_best_clusters_of_two_and_one() -> None:
    uneven = tuple(
        sum(g // size for g in (18, 18, 18, 18, 16, 16, 14, 14)) for size in range(1, 9)
    )
    kernels = skinny_mma.SkinnyMma.__new__(skinny_mma.SkinnyMma)  # no device: the planner only
    kernels._kernels = type("K", (), {"num_sms": 132, "max_shared_mem": H100_SHARED})()
    kernels.clusters = uneven
    for n, k in ((4096, 14336), (6144, 4096), (4096, 4096), (28672, 4096)):
        found = skinny_mma.candidates(64, n, k, 132, H100_SHARED, uneven)
        picked = kernels.choices(64, n, k)
        assert picked[0] == found[0]  # the plan first
        assert len(set(picked)) == len(picked) <= 3
        for ks in (2, 1):  # the best of each cluster size is there, if any fits
            best = next((p for p in found if p.ks == ks), None)
            assert best is None or best in picked


class FakeKernels:
    """A SkinnyMma stand-in: its product, marked by a count of launches."""

    def __init__(self) -> None:
        self.launches = 0

    def plan(self, m, n, k):
        return skinny_mma.plan(m, n, k, 132, H100_SHARED)

    def choices(self, m, n, k):
        return [self.plan(m, n, k)]

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

    choice = skinny_choice.SkinnyChoice(TuningCache(DEVICE, tmp_path), counting_timer)
    ops._skinny_choices[torch.device("cpu")] = choice  # the fakes' tensors are the host's
    return ops, kernels, capturing


def chosen(ops) -> dict:
    return ops._skinny_choices[torch.device("cpu")].chosen


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


def test_auto_times_only_the_decode_buckets_row_counts(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("XHAL_CUDA_SKINNY_MMA", raising=False)
    ops, kernels, capturing = fake_ops(monkeypatch, tmp_path, (5e-6, 10e-6))
    w = torch.randn(32, 64)
    for rows in (3, 5, 23, 40):  # an eager prefill of a few tokens: cuBLAS, nothing timed
        x = torch.randn(rows, 64)
        torch.testing.assert_close(ops.linear(x, w), x @ w.T)
    assert kernels.launches == 0 and chosen(ops) == {}
    x = torch.randn(48, 64)
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)
    assert kernels.launches == 2  # timed once, then run


def test_auto_takes_cublas_where_no_launch_shape_fits_the_device(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("XHAL_CUDA_SKINNY_MMA", raising=False)
    ops, kernels, capturing = fake_ops(monkeypatch, tmp_path, (5e-6, 10e-6))
    monkeypatch.setattr(kernels, "choices", lambda m, n, k: [])
    x, w = torch.randn(16, 64), torch.randn(32, 64)
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)
    capturing["now"] = True
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)
    assert kernels.launches == 0 and chosen(ops) == {}


@pytest.mark.parametrize(("setting", "launches"), [("1", 1), ("0", 0)])
def test_forced_settings_never_time(monkeypatch, tmp_path, setting, launches) -> None:
    monkeypatch.setenv("XHAL_CUDA_SKINNY_MMA", setting)
    ops, kernels, capturing = fake_ops(monkeypatch, tmp_path, (10e-6, 5e-6))  # cuBLAS faster
    x, w = torch.randn(16, 64), torch.randn(32, 64)
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)
    assert kernels.launches == launches  # "1" launches without timing, "0" never
    assert chosen(ops) == {}


def test_timed_rows_are_the_default_decode_buckets_past_one_row():
    """``TIMED_ROWS`` restates the executor's default buckets up to 64 (a backend may not import
    the executor): the two must not drift apart, or a bucket's projections go untimed."""
    from xhal.executor import ExecutorConfig

    buckets = ExecutorConfig(max_num_seqs=64).decode_capture_sizes
    assert skinny_choice.TIMED_ROWS == tuple(m for m in buckets if m > 1)
