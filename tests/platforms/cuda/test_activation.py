"""The CUDA platform's gated-activation kernel (``kernels/activation.py``) against float64
references, in Triton's interpreter on CPU (compiled where a GPU is present): every activation and
dtype, odd widths, several programs per row, strided rows, leading dimensions; and that CudaOps
runs it for the plain ops and before the down projection at 2+ rows, the torch sequence with
``XHAL_CUDA_TRITON_ACTIVATION=0``."""

from __future__ import annotations

import pytest
import torch

from conformance_tests import ops_reference
from tests.support.triton_env import DEVICE, assert_matches

# triton_env sets TRITON_INTERPRET before any triton kernel is imported: keep it first
# isort: split
from xhal.platforms.cuda.kernels import activation

F64 = torch.float64
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rand(*shape, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(DEVICE, dtype)


def _reference(x: torch.Tensor, name: str) -> torch.Tensor:
    """float64 on the CPU: the conformance suite's references, written from the definitions
    independently of the kernel and of torch's F."""
    if name == "silu":
        return ops_reference.silu_and_mul(x)
    return ops_reference.gelu_and_mul(x, name)


# (shape): an odd width, leading dims, a width past one program (1024 outputs), one row
SHAPES = [(3, 2 * 11), (2, 3, 2 * 40), (2, 2 * 1030), (1, 2 * 7)]


@pytest.mark.parametrize("name", ["silu", "none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_float64(shape, dtype, name) -> None:
    x = _rand(*shape, dtype=dtype, seed=len(shape) + shape[-1])
    before = x.clone()
    out = activation.gated_activation(x, name)
    assert out.is_contiguous() and out.device == x.device
    assert_matches(out.cpu(), _reference(x, name), dtype)
    assert torch.equal(x, before), "the input changed"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_rows_read_only_their_halves(dtype) -> None:
    """Rows of a wider buffer (a view, as a fused gate_up output sliced per rank could be):
    each row's gate and up are the first and second half of its own slice."""
    wide = _rand(4, 2 * 24 + 10, dtype=dtype, seed=7)
    x = wide[:, 5 : 5 + 2 * 24]
    assert not x.is_contiguous()
    assert_matches(activation.silu_and_mul(x).cpu(), _reference(x, "silu"), dtype)
    # a transposed input (last stride not 1) is copied first, not misread
    xt = _rand(2 * 6, 3, dtype=dtype, seed=8).t()
    assert_matches(activation.gelu_and_mul(xt, "tanh").cpu(), _reference(xt, "tanh"), dtype)


@pytest.mark.parametrize("name", ["silu", "none", "tanh"])
def test_large_gates_saturate_without_nan(name) -> None:
    """exp overflows for |gate| near 90 in float32: the kernel's forms take the exact limits
    (0 for a very negative gate, gate * up for a very positive one), never NaN."""
    gate = torch.tensor([[-200.0, -90.0, -30.0, 0.0, 30.0, 90.0, 200.0]], dtype=F64)
    x = torch.cat([gate, torch.full_like(gate, 2.0)], dim=-1).to(DEVICE, torch.float32)
    out = activation.gated_activation(x, name).cpu()
    assert torch.isfinite(out).all()
    assert_matches(out, _reference(x, name), torch.float32)


def test_empty_rows_and_bad_input() -> None:
    empty = torch.empty(0, 2 * 8, device=DEVICE, dtype=torch.bfloat16)
    assert activation.silu_and_mul(empty).shape == (0, 8)
    with pytest.raises(ValueError, match="even last dimension"):
        activation.silu_and_mul(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="float16 / bfloat16 / float32"):
        activation.silu_and_mul(torch.zeros(2, 8, device=DEVICE, dtype=F64))
    with pytest.raises(ValueError, match="expected one of"):
        activation.gated_activation(torch.zeros(2, 8, device=DEVICE), "relu")
    with pytest.raises(ValueError, match="'none' or 'tanh'"):
        activation.gelu_and_mul(torch.zeros(2, 8, device=DEVICE), "fast")
    assert activation.supports(torch.zeros(3, 8, dtype=torch.float16))
    assert not activation.supports(torch.zeros(3, 8, dtype=F64))
    assert not activation.supports(torch.zeros(3, 9))


# CudaOps' choice -----------------------------------------------------------------------------


@pytest.fixture
def kernel_calls(monkeypatch) -> list[str]:
    """The activations CudaOps sends to the Triton kernel, by name, the kernel still run."""
    from xhal.platforms.cuda import ops as cuda_ops

    calls: list[str] = []
    real = activation.gated_activation

    def counting(x, name):
        calls.append(name)
        return real(x, name)

    monkeypatch.setattr(cuda_ops.activation, "gated_activation", counting)
    monkeypatch.delenv("XHAL_CUDA_TRITON_ACTIVATION", raising=False)
    return calls


def test_cuda_ops_run_the_kernel_for_the_activations(kernel_calls) -> None:
    from xhal.platforms.cuda.ops import CudaOps

    ops = CudaOps()
    x = _rand(5, 2 * 12, dtype=torch.bfloat16, seed=3)
    assert_matches(ops.silu_and_mul(x).cpu(), _reference(x, "silu"), torch.bfloat16)
    assert_matches(ops.gelu_and_mul(x).cpu(), _reference(x, "none"), torch.bfloat16)
    assert_matches(ops.gelu_and_mul(x, "tanh").cpu(), _reference(x, "tanh"), torch.bfloat16)
    assert kernel_calls == ["silu", "none", "tanh"]
    # float64 is not the kernel's: the torch sequence, same semantics (float32 inside)
    xd = _rand(2, 2 * 4, dtype=F64, seed=4)
    torch.testing.assert_close(
        ops.silu_and_mul(xd).cpu(), _reference(xd, "silu"), rtol=1e-6, atol=1e-6
    )
    assert kernel_calls == ["silu", "none", "tanh"]


def test_down_projection_of_several_rows_runs_the_kernel_first(kernel_calls) -> None:
    """At 2+ rows the fused op is the activation then the linear: the activation is ours (the
    batch-64 step's four torch kernels), one row in a graph stays the fused GEMV's."""
    from xhal.platforms.cuda.ops import CudaOps

    x = _rand(4, 2 * 16, dtype=torch.float32, seed=5)
    w = _rand(6, 16, dtype=torch.float32, seed=6, scale=0.5)
    want = _reference(x, "silu") @ w.to("cpu", F64).T
    assert_matches(CudaOps().silu_and_mul_linear(x, w).cpu(), want, torch.float32)
    assert kernel_calls == ["silu"]


def test_the_switch_restores_the_torch_sequence(kernel_calls, monkeypatch) -> None:
    from xhal.platforms.cuda.ops import CudaOps

    monkeypatch.setenv("XHAL_CUDA_TRITON_ACTIVATION", "0")
    ops = CudaOps()
    x = _rand(3, 2 * 10, dtype=torch.float16, seed=9)
    assert_matches(ops.silu_and_mul(x).cpu(), _reference(x, "silu"), torch.float16)
    assert_matches(ops.gelu_and_mul(x, "tanh").cpu(), _reference(x, "tanh"), torch.float16)
    assert kernel_calls == []
    monkeypatch.setenv("XHAL_CUDA_TRITON_ACTIVATION", "sometimes")
    with pytest.raises(ValueError, match="XHAL_CUDA_TRITON_ACTIVATION"):
        ops.silu_and_mul(x)
