"""The kernels of the fused decode GEMVs (``fused_gemv.py`` launches them): one program layout
for the plain GEMV and for the two fused prologues, and the split-K reduce.

The program layout is ``gemv.py``'s (BLOCK_N weight rows, one K range, products kept unreduced
until the loop ends, a deterministic split-K reduce); its launch shapes are in
``fused_gemv_config.py``. What is fused is computed on the x tile a program loads anyway, so the
weight stream is unchanged and one launch (plus the reduce when K is split) replaces two or three:

- norm: each step adds the residual tile (rounded to the dtype, as the unfused op stores it),
  multiplies by the norm weight and accumulates the sum of squares next to the products; the
  row's ``1 / rms`` is a scalar, so it scales the finished dot product (or the split-K reduce
  does, from each split's sum of squares). The normed input is therefore not rounded to the
  dtype before the product, one rounding fewer than the unfused sequence (see the conformance
  fused family for the tolerance). Programs of the first row block also store the new residual.
- silu: ``silu(gate) * up`` rounded to the dtype, exactly the unfused op's input to the GEMV.

Programmatic dependent launch (sm_90+, ``use_pdl``, the rule in ``xhal/platforms/cuda/pdl.py``):
the kernel is launched with the PDL attribute, so it is scheduled while the previous kernel
drains; it loads its first weight tile (weights never depend on earlier kernels) and then waits
(``griddepcontrol``) before its first load of x; it lets the next kernel launch right after that
wait (``pdl.EARLY``) or after its weight stream (``pdl.LATE``). ``use_pdl=0`` compiles the kernel
without any of it.

Weight tiles through TMA (``GemvConfig.tma``): Triton's pipeliner keeps ``num_stages - 1`` tiles
of a tensor-descriptor load in flight in shared memory whether or not they feed a ``tl.dot``,
where the plain loads leave a program about one tile in flight (``fused_gemv_config.py``). The
descriptor is built on the host per launch (a kernel argument, so a captured graph keeps it).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _input(
    x_rows, ks, k_mask, xm, res_ptr, res_stride, g_ptr, sum_ptr, ms, store_sum, dtype,
    K: tl.constexpr, PROLOGUE: tl.constexpr,
):
    """The GEMV's input at columns ``ks`` (the fused op applied to the x tile), fp32 [BLOCK_M, W],
    and (norm only: callers ignore it otherwise) the squares of the summed input for 1/rms."""
    if PROLOGUE == 1:  # residual add + RMSNorm, 1/rms applied after the loop
        x = tl.load(x_rows + ks[None, :], mask=xm, other=0.0).to(tl.float32)
        r = tl.load(res_ptr + ms[:, None] * res_stride + ks[None, :], mask=xm, other=0.0)
        s = (x + r.to(tl.float32)).to(dtype)  # the residual stream keeps the input dtype
        tl.store(sum_ptr + ms[:, None] * K + ks[None, :], s, mask=xm & store_sum)
        s = s.to(tl.float32)
        a = s * tl.load(g_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        return a, s * s
    elif PROLOGUE == 2:  # silu(gate) * up, rounded as the unfused op stores it
        gate = tl.load(x_rows + ks[None, :], mask=xm, other=0.0).to(tl.float32)
        up = tl.load(x_rows + K + ks[None, :], mask=xm, other=0.0).to(tl.float32)
        a = (gate * tl.sigmoid(gate) * up).to(dtype).to(tl.float32)
        return a, a
    else:
        a = tl.load(x_rows + ks[None, :], mask=xm, other=0.0).to(tl.float32)
        return a, a


@triton.jit
def _flush(
    out, sumsq, block, ms, m_mask, rows, row_mask, N, pid_k, eps, bias_ptr, out_ptr, part_ptr,
    sq_ptr, dtype, K: tl.constexpr, M: tl.constexpr, PROLOGUE: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """One row block's epilogue: [BLOCK_M, BLOCK_N] fp32 dot products (and the rows' sum of
    squares) scaled, biased and stored, or stored as this split's partials."""
    if PROLOGUE == 1:
        if SPLIT:  # the split's sum of squares, the same for every row block: block 0 stores it
            tl.store(sq_ptr + pid_k * M + ms, sumsq, mask=m_mask & (block == 0))
        else:
            out = out * tl.rsqrt(sumsq / K + eps)[:, None]
    offs = ms[:, None] * N + rows[None, :]
    mask = m_mask[:, None] & row_mask[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k * M * N + offs, out, mask=mask)
    else:
        if HAS_BIAS:
            out += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, out.to(dtype), mask=mask)


@triton.jit
def _weight_tile(w_ptr, rows, row_mask, ks, k_mask, row0, k0, K: tl.constexpr, TMA: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at rows ``row0``.., columns ``k0``..: through the TMA
    descriptor ``w_ptr`` (out-of-range rows and columns read as zeros), which Triton's pipeliner
    keeps ``num_stages - 1`` tiles ahead in shared memory (it pipelines plain loads only when they
    feed a ``tl.dot``), or a masked plain load."""
    if TMA:
        w = w_ptr.load([row0, k0])
    else:
        w = tl.load(
            w_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
    return w


@triton.jit
def _fused_gemv_kernel(
    x_ptr, res_ptr, g_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, sum_ptr, sq_ptr,
    N, x_stride, res_stride, eps,
    K: tl.constexpr, K_PER_SPLIT: tl.constexpr, M: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr, SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
    TMA: tl.constexpr = False,
):
    STEPS: tl.constexpr = K_PER_SPLIT // BLOCK_K
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    ms = tl.arange(0, BLOCK_M)
    m_mask = ms < M
    x_rows = x_ptr + ms[:, None] * x_stride
    dtype = out_ptr.dtype.element_ty
    k_start = pid_k * K_PER_SPLIT
    # the first step is peeled: its weight tile (weights never depend on the previous kernel) is
    # loaded before waiting for that kernel under PDL, so the stream starts during its tail
    ks = k_start + tl.arange(0, BLOCK_K)
    k_mask = ks < K
    w = _weight_tile(w_ptr, rows, row_mask, ks, k_mask, pid_n * BLOCK_N, k_start, K, TMA)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x (and the residual) come from the previous kernel
    if USE_PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    a, q = _input(
        x_rows, ks, k_mask, m_mask[:, None] & k_mask[None, :], res_ptr, res_stride, g_ptr,
        sum_ptr, ms, pid_n == 0, dtype, K, PROLOGUE,
    )
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc += a[:, None, :] * w.to(tl.float32)[None, :, :]
    sq = q if PROLOGUE == 1 else tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for t in tl.range(1, STEPS, num_stages=NUM_STAGES):
        ks = k_start + t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w = _weight_tile(
            w_ptr, rows, row_mask, ks, k_mask, pid_n * BLOCK_N, k_start + t * BLOCK_K, K, TMA
        )
        a, q = _input(
            x_rows, ks, k_mask, m_mask[:, None] & k_mask[None, :], res_ptr, res_stride, g_ptr,
            sum_ptr, ms, pid_n == 0, dtype, K, PROLOGUE,
        )
        acc += a[:, None, :] * w.to(tl.float32)[None, :, :]
        if PROLOGUE == 1:
            sq += q
    if USE_PDL == 2:  # the weights are streamed: the next kernel's programs may take the SMs
        tl.extra.cuda.gdc_launch_dependents()
    _flush(
        tl.sum(acc, axis=2),  # [BLOCK_M, BLOCK_N]
        tl.sum(sq, axis=1),  # [BLOCK_M], this split's part
        pid_n, ms, m_mask, rows, row_mask, N, pid_k, eps, bias_ptr, out_ptr, part_ptr, sq_ptr,
        dtype, K, M, PROLOGUE, SPLIT, HAS_BIAS,
    )


@triton.jit
def _fused_reduce_kernel(
    part_ptr,
    sq_ptr,
    bias_ptr,
    out_ptr,
    N,
    MN,
    eps,
    K: tl.constexpr,
    M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    ss = tl.zeros([BLOCK], dtype=tl.float32)
    m = offs // N
    for s in tl.static_range(SPLIT_K):  # fixed order: the same bits every run
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
        if NORM:
            ss += tl.load(sq_ptr + s * M + m, mask=mask, other=0.0)
    if NORM:
        acc = acc * tl.rsqrt(ss / K + eps)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
