"""linear=triton-tuned (xhal/platforms/cuda/tuned_gemv.py): every config of its space computes the
float64 result, the autotuner picks one per bucket, and it is registered below the plain GEMV so the
default choice does not change. Interpreted on CPU without a CUDA device (tests/triton_env.py)."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_env import DEVICE, assert_matches

# triton_env sets TRITON_INTERPRET before any triton kernel is imported: keep it first
# isort: split
from xhal import solutions
from xhal.platforms.cuda.tuned_gemv import TunedGemv, bucket
from xhal.solutions.timing import Timer
from xhal.solutions.tuned_op import TunedOp
from xhal.solutions.tuning_cache import TuningCache

SOLUTION = next(s for s in solutions.solutions("linear", "cuda") if s.name == "triton-tuned")


@pytest.mark.parametrize("m,n,k", [(1, 100, 72), (3, 40, 300), (16, 64, 64)], ids=str)
@pytest.mark.parametrize("config", SOLUTION.configs, ids=lambda c: c.name)
def test_every_config_matches_float64(m, n, k, config) -> None:
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE)
    out = TunedGemv(None).linear(x, w, b, **config.params)
    assert_matches(out, x.double() @ w.double().T + b.double(), torch.float32)


def test_tuned_once_per_bucket_and_ranked_below_the_plain_gemv(tmp_path) -> None:
    names = [s.name for s in solutions.solutions("linear", "cuda")]
    assert names.index("triton") < names.index("triton-tuned") < names.index("vendor"), names
    device = solutions.DeviceInfo("cuda", "test device")
    tuned = TunedOp(
        SOLUTION,
        TunedGemv(None).linear,
        bucket,
        TuningCache(device, tmp_path),
        Timer(lambda: None, warmup=1, repeats=1),
        lambda: False,
    )
    x, w = torch.randn(2, 64).to(DEVICE), torch.randn(48, 64).to(DEVICE)
    assert_matches(tuned(x, w, None), x.double() @ w.double().T, torch.float32)
    assert set(tuned.chosen) == {"m2-n48-k64-float32"} and tuned.chosen["m2-n48-k64-float32"] in {
        c.name for c in SOLUTION.configs
    }
    big = torch.randn(100, 64).to(DEVICE)  # past the GEMV's 64 rows: cuBLAS, every config alike
    torch.testing.assert_close(tuned(big, w, None), torch.nn.functional.linear(big, w))
