"""Device ops family: every ``xhal.ops`` function on the platform's tensors against float64
references (``ops_reference``), for each declared dtype; sampling semantics; tracing."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conformance_tests import ops_reference as ref
from conformance_tests.coverage import dtype_name
from conformance_tests.ops_family import _platform_ops_active, pytest_generate_tests  # noqa: F401
from conformance_tests.tolerances import tolerance
from xhal import ops


def rand(
    *shape: int, dtype: torch.dtype, device, scale: float = 1.0, seed: int = 0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU so every device sees the same values
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device, dtype)


def check(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, record_error) -> None:
    """float32: within the table's tolerance of the float64 reference. bfloat16 / float16: within
    ``ULPS`` units in the last place of the reference rounded once to ``dtype``, what computing in
    float32 and rounding the result once gives (a missing float32 upcast rounds several times)."""
    assert out.dtype == dtype, f"output dtype {out.dtype}, expected the input's {dtype}"
    err = ref.max_error(out, expected)
    record_error(err)
    if dtype in ref.ULP_BITS:
        ulps = ref.max_ulps(out, expected, dtype)
        assert ulps <= ref.ULPS, (
            f"{ulps:.1f} ulp from the float64 reference rounded once to {dtype} (tolerance "
            f"{ref.ULPS} ulp): compute in float32 and round once"
        )
        return
    assert err <= tolerance("ops", dtype), f"max error {err:.3e} > {tolerance('ops', dtype):.1e}"


# small M is where a platform may swap in its own kernel (GEMV for decode); sizes off powers of 2
LINEAR_CASES = [
    (1, 256, 96),
    (2, 200, 72),
    (3, 64, 1000),
    (4, 512, 520),
    (8, 136, 40),
    (16, 64, 64),
    (33, 128, 96),
]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m,k,n", LINEAR_CASES, ids=str)
def test_linear(m, k, n, bias, dtype, device, record_error, record_coverage) -> None:
    x = rand(m, k, dtype=dtype, device=device)
    w = rand(n, k, dtype=dtype, device=device, scale=k**-0.5, seed=1)
    b = rand(n, dtype=dtype, device=device, seed=2) if bias else None
    check(ops.linear(x, w, b), ref.linear(x, w, b), dtype, record_error)
    record_coverage(f"ops dtype {dtype_name(dtype)}")


@pytest.mark.parametrize("m,k,n", [c for c in LINEAR_CASES if c[0] <= 4], ids=str)
def test_linear_in_a_graph(m, k, n, platform, dtype, device, record_error) -> None:
    """Decode steps run their linears captured: a platform may pick another kernel there."""
    if not platform.capabilities.graphs:
        pytest.skip(f"{platform.name} declares no graphs")
    x = rand(m, k, dtype=dtype, device=device)
    w = rand(n, k, dtype=dtype, device=device, scale=k**-0.5, seed=1)
    b = rand(n, dtype=dtype, device=device, seed=2)
    runner = platform.graph_runner()
    runner.capture("linear", lambda: ops.linear(x, w, b))
    x.copy_(rand(m, k, dtype=dtype, device=device, seed=3))  # replay reads the new input
    out = runner.replay("linear")
    platform.synchronize()
    check(out, ref.linear(x, w, b), dtype, record_error)


def test_linear_strided_and_batched_inputs(dtype, device, record_error) -> None:
    w = rand(48, 80, dtype=dtype, device=device, scale=80**-0.5, seed=1)
    wide = rand(2, 160, dtype=dtype, device=device)
    strided = wide[:, :80]  # rows 160 apart, as a slice of a fused projection is
    check(ops.linear(strided, w), ref.linear(strided, w, None), dtype, record_error)
    batched = rand(2, 3, 80, dtype=dtype, device=device)
    check(ops.linear(batched, w), ref.linear(batched, w, None), dtype, record_error)


# eps=0.5 on small inputs makes an ignored eps visible
NORM_CASES = [
    ((7, 64), 1e-6, 1.0),
    ((5, 4, 128), 1e-5, 1.0),
    ((2, 3, 96), 0.5, 0.3),
    ((32,), 1e-6, 1.0),
]


@pytest.mark.parametrize("shape,eps,scale", NORM_CASES, ids=lambda c: str(c))
def test_rms_norm(shape, eps, scale, dtype, device, record_error) -> None:
    x = rand(*shape, dtype=dtype, device=device, scale=scale)
    w = 1.0 + rand(shape[-1], dtype=dtype, device=device, scale=0.1, seed=1)
    x_before = x.clone()
    check(ops.rms_norm(x, w, eps), ref.rms_norm(x, w, eps), dtype, record_error)
    assert torch.equal(x, x_before), "rms_norm changed its input in place"


@pytest.mark.parametrize("shape,eps,scale", NORM_CASES, ids=lambda c: str(c))
def test_fused_add_rms_norm(shape, eps, scale, dtype, device, record_error) -> None:
    x = rand(*shape, dtype=dtype, device=device, scale=scale)
    residual = rand(*shape, dtype=dtype, device=device, scale=scale, seed=2)
    w = 1.0 + rand(shape[-1], dtype=dtype, device=device, scale=0.1, seed=1)
    before = (x.clone(), residual.clone())
    normed, new_residual = ops.fused_add_rms_norm(x, residual, w, eps)
    expected_normed, expected_residual = ref.fused_add_rms_norm(x, residual, w, eps)
    check(new_residual, expected_residual, dtype, record_error)
    check(normed, expected_normed, dtype, record_error)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1]), "inputs changed in place"


ROPE_CASES = [  # head_dim, rotary_dim, num_heads, num_kv_heads
    (64, 64, 4, 2),
    (128, 128, 8, 1),
    (128, 64, 4, 4),  # partial rotary: channels 64.. pass through
    (80, 32, 6, 2),
]


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rotary_dim,num_heads,num_kv_heads", ROPE_CASES)
def test_rotary_embedding(
    head_dim, rotary_dim, num_heads, num_kv_heads, is_neox, dtype, device, record_error
) -> None:
    num_tokens, max_position = 9, 64
    # unordered positions with a repeat, as a mixed batch has
    positions = torch.tensor([5, 0, 63, 17, 17, 2, 40, 1, 33], dtype=torch.int32, device=device)
    cache = ref.rope_cache(max_position, rotary_dim).to(device)
    q = rand(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    k = rand(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device, seed=3)
    before = (q.clone(), k.clone())
    q_out, k_out = ops.rotary_embedding(positions, q, k, cache, is_neox)
    check(q_out, ref.rotary_embedding(positions, q, cache, is_neox), dtype, record_error)
    check(k_out, ref.rotary_embedding(positions, k, cache, is_neox), dtype, record_error)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1]), "q or k changed in place"


ACT_SHAPES = [(7, 2 * 96), (2, 3, 2 * 40), (1, 2 * 11)]


@pytest.mark.parametrize("shape", ACT_SHAPES, ids=str)
def test_silu_and_mul(shape, dtype, device, record_error) -> None:
    x = rand(*shape, dtype=dtype, device=device, scale=2.0)
    check(ops.silu_and_mul(x), ref.silu_and_mul(x), dtype, record_error)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", ACT_SHAPES, ids=str)
def test_gelu_and_mul(shape, approximate, dtype, device, record_error) -> None:
    x = rand(*shape, dtype=dtype, device=device, scale=2.0)
    out = ops.gelu_and_mul(x, approximate)
    check(out, ref.gelu_and_mul(x, approximate), dtype, record_error)


# sampling ------------------------------------------------------------------------------------


def logits_with_ties(dtype: torch.dtype, device) -> torch.Tensor:
    logits = rand(6, 50, dtype=dtype, device=device)
    logits[0, [7, 30]] = 10.0  # tie far apart -> 7
    logits[1] = 1.0  # all tied -> 0
    logits[2, [49, 48]] = 10.0  # tie at the end -> 48
    return logits


def sample(logits, temperature, top_k, top_p, seed: int = 0) -> torch.Tensor:
    """``xhal.ops.sample`` with per-row settings given as lists."""
    device, rows = logits.device, logits.shape[0]
    out = ops.sample(
        logits,
        torch.tensor(temperature, dtype=torch.float32, device=device).expand(rows).contiguous(),
        torch.tensor(top_k, dtype=torch.int32, device=device).expand(rows).contiguous(),
        torch.tensor(top_p, dtype=torch.float32, device=device).expand(rows).contiguous(),
        torch.Generator(device=device).manual_seed(seed),
    )
    assert out.dtype == torch.int64 and out.shape == (rows,), f"got {out.dtype} {tuple(out.shape)}"
    return out.cpu()


def test_argmax(dtype, device) -> None:
    logits = logits_with_ties(dtype, device)
    out = ops.argmax(logits)
    assert out.dtype == torch.int64 and out.shape == (6,)
    assert out.cpu().tolist() == ref.argmax(logits).tolist()


def test_temperature_zero_is_argmax(dtype, device) -> None:
    logits = logits_with_ties(dtype, device)
    temperature = [0.0, 0.0, 0.0, 0.8, 0.0, 1.5]
    # greedy rows ignore top-k / top-p settings
    out = sample(logits, temperature, [0, 5, 0, 0, 1, 3], [1.0, 0.5, 1.0, 0.9, 1.0, 1.0])
    greedy = [i for i, t in enumerate(temperature) if t == 0.0]
    assert out[greedy].tolist() == ref.argmax(logits)[greedy].tolist()


def test_same_generator_same_tokens(dtype, device) -> None:
    logits = rand(16, 100, dtype=dtype, device=device, scale=0.5)  # flat: many likely tokens
    a = sample(logits, [1.0], [0], [1.0], seed=1234)
    b = sample(logits, [1.0], [0], [1.0], seed=1234)
    assert a.tolist() == b.tolist(), "the same generator seed gave different tokens"
    assert int(a.min()) >= 0 and int(a.max()) < 100


def test_top_k_samples_only_the_k_largest(dtype, device) -> None:
    rows, vocab = 4, 40
    base = rand(rows, vocab, dtype=dtype, device=device)
    base[3, :6] = torch.tensor([5.0, 4.0, 3.0, 3.0, 3.0, 1.0], dtype=dtype)  # ties at the 3rd value
    base[3, 6:] = base[3, 6:].clamp(max=0.5)
    logits = base.repeat_interleave(50, dim=0)  # 50 draws per row
    top_k = [1, 3, 7, 3]
    out = sample(logits, [2.0], [k for k in top_k for _ in range(50)], [1.0])  # hot: spread out
    for r in range(rows):
        allowed = ref.sampling_distribution(base[r], 2.0, top_k[r], 1.0) > 0
        drawn = out[r * 50 : (r + 1) * 50]
        assert bool(allowed[drawn].all()), f"row {r}: token outside the top-{top_k[r]} set"
    # row 3 keeps all three tokens tied at the 3rd value: each is drawn ~14% of the time
    assert set(out[150:].tolist()) == {0, 1, 2, 3, 4}, "tokens tied at the k-th value were dropped"


def test_top_p_samples_only_the_nucleus(dtype, device) -> None:
    head = torch.tensor([0.36, 0.27, 0.135, 0.09, 0.045], dtype=torch.float64)
    probs = torch.cat([head, torch.full((11,), 0.1 / 11, dtype=torch.float64)])
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    row = probs.log()[perm].to(device, dtype)  # likely tokens at scattered indices
    # (top_k, top_p, nucleus size): top-k before top-p gives 2 for (3, 0.8), top-p first gives 3
    cases = [(0, 0.5, 2), (3, 0.8, 2), (0, 1.0, 16), (0, 0.01, 1), (2, 1.0, 2)]
    draws = 100
    out = sample(
        row.expand(len(cases) * draws, 16).contiguous(),
        [1.0],
        [k for k, _, _ in cases for _ in range(draws)],
        [p for _, p, _ in cases for _ in range(draws)],
    )
    for i, (k, p, size) in enumerate(cases):
        allowed = ref.sampling_distribution(row, 1.0, k, p) > 0
        assert int(allowed.sum()) == size, "reference nucleus disagrees with the hand count"
        drawn = out[i * draws : (i + 1) * draws]
        assert bool(allowed[drawn].all()), f"top_k={k} top_p={p}: token outside the nucleus"
        if size == 2:  # both nucleus tokens are likely enough to show up in 100 draws
            assert set(drawn.tolist()) == set(allowed.nonzero().flatten().tolist())


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 4, 0.8)])
def test_sampling_distribution(temperature, top_k, top_p, dtype, device) -> None:
    # 4000 draws on 8 tokens: expected total variation ~0.016, so 0.05 fails only real bias
    draws, vocab = 4000, 8
    row = rand(vocab, dtype=dtype, device=device, scale=1.5, seed=7)
    out = sample(row.expand(draws, vocab).contiguous(), [temperature], [top_k], [top_p], seed=3)
    empirical = torch.bincount(out, minlength=vocab).double() / draws
    expected = ref.sampling_distribution(row, temperature, top_k, top_p)
    tv = 0.5 * float((empirical - expected).abs().sum())
    assert tv < 0.05, (
        f"total variation {tv:.3f}: sampled {empirical.tolist()}, want {expected.tolist()}"
    )


# every row its own temperature, top-k and top-p, as one served batch mixes requests
PER_ROW_SETTINGS = [(0.7, 0, 1.0), (1.3, 4, 0.8), (1.0, 2, 1.0), (2.0, 0, 0.6)]


def test_per_row_sampling_parameters(dtype, device) -> None:
    """Rows with different settings in one batch, interleaved: each setting's draws follow its
    own row's distribution (a kernel that applies row 0's settings to every row fails)."""
    draws, vocab, n = 1000, 8, len(PER_ROW_SETTINGS)
    rows = torch.stack(
        [rand(vocab, dtype=torch.float64, device="cpu", scale=1.5, seed=11 + i) for i in range(n)]
    )
    logits = rows.repeat(draws, 1).to(device, dtype)  # row r has setting r % n
    temperature = [t for _ in range(draws) for t, _, _ in PER_ROW_SETTINGS]
    top_k = [k for _ in range(draws) for _, k, _ in PER_ROW_SETTINGS]
    top_p = [p for _ in range(draws) for _, _, p in PER_ROW_SETTINGS]
    out = sample(logits, temperature, top_k, top_p, seed=5)
    for i, (t, k, p) in enumerate(PER_ROW_SETTINGS):
        empirical = torch.bincount(out[i::n], minlength=vocab).double() / draws
        expected = ref.sampling_distribution(logits[i], t, k, p)
        tv = 0.5 * float((empirical - expected).abs().sum())
        # expected total variation ~0.03 at 1000 draws; another row's settings give > 0.2
        assert tv < 0.1, (
            f"rows with temperature={t} top_k={k} top_p={p}: total variation {tv:.3f} from "
            f"their distribution (sampled {empirical.tolist()}, want {expected.tolist()})"
        )


# tracing -------------------------------------------------------------------------------------


def op_calls(device, dtype: torch.dtype) -> dict[str, tuple]:
    """Small real inputs for each custom op: the op's torch.ops handle and its arguments."""
    x, w = rand(3, 4, 64, dtype=dtype, device=device), rand(64, dtype=dtype, device=device)
    pos = torch.tensor([0, 3, 1], dtype=torch.int32, device=device)
    cache = ref.rope_cache(8, 32).to(device)
    k = rand(3, 2, 64, dtype=dtype, device=device)
    xo = torch.ops.xhal
    return {
        "rms_norm": (xo.rms_norm.default, (x, w, 1e-6)),
        "fused_add_rms_norm": (xo.fused_add_rms_norm.default, (x, x.clone(), w, 1e-6)),
        "rotary_embedding": (xo.rotary_embedding.default, (pos, x, k, cache, True)),
        "silu_and_mul": (xo.silu_and_mul.default, (x,)),
        "gelu_and_mul": (xo.gelu_and_mul.default, (x, "tanh")),
    }


OP_NAMES = ["rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "gelu_and_mul"]


@pytest.mark.parametrize("name", OP_NAMES)
def test_opcheck(name, device) -> None:
    """Schema, fake kernel vs real kernel, and AOT dispatch agree (torch.library.opcheck)."""
    op, args = op_calls(device, torch.float32)[name]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("name", OP_NAMES)
def test_fake_and_meta_tensors(name, device) -> None:
    op, args = op_calls(device, torch.float32)[name]
    real = op(*args)
    with FakeTensorMode() as mode:  # fake tensors keep the device; meta tensors move to "meta"
        fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    meta = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
    for want, got, where in [(real, fake, device.type), (real, meta, "meta")]:
        want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
        for w, g in zip(want, got):
            assert (g.shape, g.dtype, g.device.type) == (w.shape, w.dtype, where)
