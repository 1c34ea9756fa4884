"""Autotuning: a solution's configs are timed the first time a shape bucket is seen, the winner
is cached on disk per device name, library versions and bucket, later starts pay nothing, and
nothing is timed inside a graph capture. A fake clock drives the selection logic; one run times
real work."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from tests.support import toy_solutions as toy
from xhal.solutions.kernels import Kernels
from xhal.solutions.solution import Config
from xhal.solutions.timing import Timer
from xhal.solutions.tuning_cache import TuningCache, cache_path


@pytest.fixture
def tunable(tmp_path, monkeypatch):
    monkeypatch.setenv("XHAL_CACHE_DIR", str(tmp_path))
    yield from toy.registered(toy.toy_solutions(tunable=True))


def fake_timer(platform) -> Timer:
    return Timer(platform.synchronize, clock=toy.CLOCK, warmup=1, repeats=3)


def kernels(**kwargs) -> Kernels:
    platform = toy.ToyPlatform()
    return Kernels(platform, toy.DEVICE, timer=fake_timer(platform), **kwargs)


def inputs(rows: int):
    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, 16, generator=g), torch.randn(8, 16, generator=g)


def test_first_sight_times_every_config_and_caches_the_fastest(tunable) -> None:
    k = kernels()
    assert k.ops.names["linear"] == "tunable"
    x, w = inputs(1)
    before = toy.TunableLinear.calls
    torch.testing.assert_close(k.ops.linear(x, w), F.linear(x, w))
    # 3 configs x (1 warm-up + 3 timed), then the call itself
    assert toy.TunableLinear.calls - before == 3 * 4 + 1
    tuned = k.ops.impls["linear"]
    assert tuned.chosen == {"m1-n8-k16": "fast"} and tuned.tuned == {"m1-n8-k16"}
    data = json.loads(cache_path(toy.DEVICE).read_text())
    assert data["winners"] == {"linear=tunable": {"m1-n8-k16": "fast"}}
    assert (
        data["device"] == "Toy Accelerator 9000"
        and data["library_versions"]["torch"] == torch.__version__
    )
    # the same bucket again, in this process and in a fresh start: no timing
    before = toy.TunableLinear.calls
    k.ops.linear(x, w)
    fresh = kernels()
    fresh.ops.linear(*inputs(1))
    assert toy.TunableLinear.calls - before == 2
    assert fresh.ops.impls["linear"].tuned == set()
    # a new bucket (3 rows -> 4) is tuned once
    before = toy.TunableLinear.calls
    fresh.ops.linear(*inputs(3))
    assert toy.TunableLinear.calls - before == 13


def test_nothing_is_timed_inside_a_graph_capture(tunable) -> None:
    capturing = [True]
    k = kernels(is_capturing=lambda: capturing[0])
    x, w = inputs(2)
    before = toy.TunableLinear.calls
    k.ops.linear(x, w)
    assert toy.TunableLinear.calls - before == 1  # the first config, untimed
    assert not cache_path(toy.DEVICE).exists() and k.ops.impls["linear"].chosen == {}
    capturing[0] = False  # the next eager call of that bucket tunes it
    k.ops.linear(x, w)
    assert k.ops.impls["linear"].chosen == {"m2-n8-k16": "fast"}


def test_autotune_off_takes_the_first_config(tunable, monkeypatch) -> None:
    monkeypatch.setenv("XHAL_AUTOTUNE", "0")
    k = kernels()
    before = toy.TunableLinear.calls
    k.ops.linear(*inputs(1))
    assert toy.TunableLinear.calls - before == 1 and k.ops.impls["linear"].chosen == {
        "m1-n8-k16": "slow"
    }


def test_a_failing_config_is_never_the_winner(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XHAL_CACHE_DIR", str(tmp_path))
    configs = (Config("broken", {"cost": 0.0, "work": "not a count"}), *toy.FAKE_COST_CONFIGS)
    for _ in toy.registered(toy.toy_solutions(tunable=True, configs=configs)):
        k = kernels()
        k.ops.linear(*inputs(1))
        assert k.ops.impls["linear"].chosen == {"m1-n8-k16": "fast"}


def test_the_cache_is_per_device_and_library_versions(tmp_path) -> None:
    other_device = dataclasses.replace(toy.DEVICE, name="Toy Accelerator 9001")
    upgraded = dataclasses.replace(toy.DEVICE, library_versions=(("torch", "99.0"),))
    paths = {cache_path(d, tmp_path) for d in (toy.DEVICE, other_device, upgraded)}
    assert len(paths) == 3
    TuningCache(toy.DEVICE, tmp_path).put("linear=tunable", "m1", "fast")
    assert TuningCache(toy.DEVICE, tmp_path).get("linear=tunable", "m1") == "fast"
    assert TuningCache(upgraded, tmp_path).get("linear=tunable", "m1") is None


def test_two_caches_of_one_file_keep_each_others_winners(tmp_path) -> None:
    # e.g. the platform's solutions and the CUDA linear's skinny GEMM choice, one device's file
    first, second = TuningCache(toy.DEVICE, tmp_path), TuningCache(toy.DEVICE, tmp_path)
    assert first.get("linear=tunable", "m1") is None and second.get("skinny", "m2") is None
    first.put("linear=tunable", "m1", "fast")
    second.put("skinny", "m2", "cublas")  # read its file before the first put, wrote after
    first.put("linear=tunable", "m4", "slow")
    assert TuningCache(toy.DEVICE, tmp_path).entries() == {
        "linear=tunable": {"m1": "fast", "m4": "slow"},
        "skinny": {"m2": "cublas"},
    }
    assert second.get("linear=tunable", "m1") == "fast"  # merged in by its own write


def test_real_timing_picks_the_config_that_does_less_work(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XHAL_CACHE_DIR", str(tmp_path))
    configs = (
        Config("heavy", {"cost": 0.0, "work": 200}),
        Config("light", {"cost": 0.0, "work": 1}),
    )
    for _ in toy.registered(toy.toy_solutions(tunable=True, configs=configs)):
        platform = toy.ToyPlatform()
        k = Kernels(platform, toy.DEVICE, timer=Timer(platform.synchronize, warmup=1, repeats=3))
        x, w = torch.randn(64, 256), torch.randn(256, 256)
        torch.testing.assert_close(k.ops.linear(x, w), F.linear(x, w))
        assert k.ops.impls["linear"].chosen == {"m64-n256-k256": "light"}
        assert platform.synchronized >= 4  # the device drained around every timed run


def test_an_unwritable_cache_costs_a_retune_not_a_failure(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XHAL_CACHE_DIR", str(blocker))  # tuning/ cannot be made under a file
    for _ in toy.registered(toy.toy_solutions(tunable=True)):
        k = kernels()
        x, w = inputs(1)
        torch.testing.assert_close(k.ops.linear(x, w), F.linear(x, w))
        assert k.ops.impls["linear"].chosen == {"m1-n8-k16": "fast"}
