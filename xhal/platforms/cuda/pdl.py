"""Programmatic dependent launch (PDL, sm_90+) across the decode chain of our Triton kernels.

A kernel launched with PDL may be scheduled while the kernel ahead of it in the stream still
runs: its programs start, do what does not depend on that kernel, then wait (``griddepcontrol
.wait``, Triton's ``gdc_wait``) until it has finished and its stores are visible. The kernel ahead
lets it launch by calling ``gdc_launch_dependents`` (or by finishing). Inside a decode graph that
hides each small kernel's launch and ramp behind its predecessor's tail.

The rule every PDL kernel here follows:

1. before its wait it writes nothing (its outputs may reuse memory the kernel ahead still reads:
   graph pools recycle buffers), and it loads only what the kernel right ahead cannot be
   writing: weights and constant tables (cos / sin), what the host staged before the step
   (positions, slot mapping, kv lengths), and what a kernel two or more launches ahead wrote.
   The last holds for a kernel whose predecessor is *gated*: one that lets its dependents
   launch only once the kernel ahead of it has finished. Ours trigger only after their own
   wait; torch's kernels (embedding, copies, the in-graph block-table layout and KV prefix sums,
   ``xhal/executor``), FlashInfer's and NCCL's are launched without PDL and trigger nothing, so
   whatever follows them launches when they finish. Then when kernel N starts, kernel N-2 and
   everything before it have finished and their stores are visible. A cuBLAS GEMM may trigger
   early (seen at batch 64); torch launches it without PDL, so it too starts only after the
   kernel ahead of it has finished, but that is cuBLAS's launch, not ours: a read before the
   wait should not rest on it. The split-KV decode launch's does not: its block table is laid
   out inside the graph by ``staged_table.py`` before the embedding, a torch kernel launched
   without PDL and triggering nothing, so the layout has finished before the embedding starts
   and the embedding before anything after it starts, whatever kernels follow. A kernel added
   to a decode chain must stay gated (trigger after its wait, or not at all), or this rule no
   longer holds for the kernel two after it. L2 prefetches (``kernels/l2_prefetch.py``) may
   address anything, since they load nothing into the program and L2 is coherent: the split-KV
   launch asks L2 for its first K / V tiles of past positions before its wait, and reads them
   with ordinary loads after it. (Past positions of a layer's cache are written only by that
   layer's attention in an earlier step, or by the host's block copies between steps; the new
   token's slot, which the launch itself writes, is a position no program of the launch reads.)
2. every program waits, also one with nothing to read: a wait covers only the kernel right
   ahead, so a grid that could finish before its own predecessor would break the chain for the
   kernel after it;
3. it triggers its dependents ``EARLY`` (right after its wait) or ``LATE`` (after its weight
   stream, before its stores); small kernels always trigger early, the split-KV decode launch
   late (after its K / V tiles; ``kernels/splitkv_decode.py`` has the figures), or early for one
   sequence under ``env.cuda_overlap``'s ``o`` (below). A GEMV triggers as
   ``XHAL_CUDA_PDL_TRIGGER`` says, ``AUTO`` by default: early below ``EARLY_BYTES`` of weight,
   late above, since the next kernel's programs, parked on the SMs through a long weight stream,
   cost more than the ramp they hide, while a short stream gains from the earlier start. The
   exception is the add + RMSNorm GEMV (qkv ahead of the split-KV launch, gate_up ahead of the
   SiLU + down GEMV), which ``AUTO`` triggers late at every size: ahead of the split-KV launch
   late won at every size (1B and MoE attention blocks 7% and 3% faster than early, ninth
   session; in the steps, one process each, 1B 0.972 against 0.988 ms, MoE 3.00 against 3.01,
   8B 4.32 both: docs/h200-results.md, tenth session), and gate_up streams 24 MiB or more in
   every model we benchmark. ``BY_SIZE`` (``XHAL_CUDA_PDL_TRIGGER=by-size``) is the size rule
   alone, ``AUTO`` before this exception, kept as the benchmarks' peer.

Measured on the H200 (2026-12-01, pipelined batch-1 decode steps, each setting's graphs captured
and timed in one process, ``benchmarks/bench_model.py --pdl`` / ``bench_moe.py --pdl``; two runs,
17:19 and 17:28 UTC, "all early" in the first only, "auto" in the second only):

| step | off | all early | all late | auto |
|---|---|---|---|---|
| Llama-3 8B shape | 4.43 / 4.42 ms | 4.66 | 4.37 / 4.37 | 4.37 |
| Llama-3.2 1B shape | 1.09 / 1.08 ms | 1.07 | 1.04 / 1.05 | 1.03 |
| Qwen3-30B-A3B shape | 3.22 / 3.22 ms | 3.05 | 3.11 / 3.13 | 3.07 |

At batch 64 (cuBLAS projections) it changes nothing measurable (8B: 9.20 off, 9.23 auto).
The sixth session's PDL, early for every GEMV, lost in the 8B step for the same reason.

The native CUDA kernels (``native.py``: the persistent MLP block, the stream GEMV) follow the
same rule: before their wait they initialise their shared-memory barriers and request weight
rows by TMA bulk copies, nothing else; they read the kernel ahead's output after it, and
trigger after their last weight stage (late), so they are gated too.

The exception is ``env.cuda_overlap`` (on by default): there the MLP block (where half an SM
holds its rings ``mlp_block.BESIDE_DEPTH`` deep) and a layer's plain stream GEMV (o) trigger
*before* their wait, once every CTA has requested its first stages, and each stream
kernel keeps to half an SM's shared memory (``native.beside_share``), so the next kernel's CTAs
land beside them and request their own weights while the kernel ahead still streams (the MLP
block) or waits (o, behind the attention). Those two are then not gated, so the kernel after
each may start before the one two ahead has finished: it must read nothing but weights before
its wait. What follows them does just that: the next layer's norm + qkv stream GEMV or the LM
head (TMA weight stages), the MLP block, a mixture of experts' norm + router (its router rows),
the Triton stream GEMVs (a weight tile) and the RMSNorm kernel (its weight). The split-KV launch,
whose reads before the wait are the ones rule 1 argues, always follows a gated kernel (the norm
+ qkv GEMV, or the q/k norm). With o beside, the one-sequence split-KV launch triggers right after
its wait (``splitkv_decode.TRIGGER_BESIDE``), so o's CTAs land beside the attention and hold their
weight slice while it runs; it stays gated.

A non-PDL kernel (cuBLAS, FlashInfer, torch) in the chain is safe either way: it starts only once
the kernel ahead has finished, and a PDL kernel after it launches when it finishes.

``XHAL_CUDA_PDL`` is the one switch (``xhal.env.cuda_pdl``); ``mode`` reads it per call, so a
graph captured with one setting keeps it, and a benchmark can capture the same model both ways.
"""

from __future__ import annotations

import functools
import logging

import torch

from xhal import env

# USE_PDL constexprs (OFF: the plain kernel), and the two rules resolved per GEMV before launch
OFF, EARLY, LATE, AUTO, BY_SIZE = 0, 1, 2, 3, 4
EARLY_BYTES = 24 << 20  # GEMVs with less weight than this trigger EARLY under AUTO and BY_SIZE
_TRIGGERS = {"early": EARLY, "late": LATE, "auto": AUTO, "by-size": BY_SIZE}

logger = logging.getLogger("xhal.platforms.cuda")


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


@functools.cache
def _log_once(choice: str) -> None:
    logger.info("programmatic dependent launch of the decode kernels: %s", choice)


def mode(device: torch.device) -> int:
    """``OFF``, or the GEMVs' trigger (``EARLY``, ``LATE``, ``AUTO``) for kernels launched on
    ``device``: off unless the switch is on and the device is a CUDA GPU of compute capability
    9.0 or more (the Triton interpreter's CPU tensors never take it)."""
    if device.type != "cuda":
        return OFF
    if not env.cuda_pdl():
        _log_once("off (XHAL_CUDA_PDL=1 turns it on)")
        return OFF
    if not _capable(device.index if device.index is not None else torch.cuda.current_device()):
        _log_once("off (needs compute capability 9.0 or more)")
        return OFF
    trigger = env.cuda_pdl_trigger()
    _log_once(f"on, GEMVs trigger {trigger} (XHAL_CUDA_PDL=0 turns it off)")
    return _TRIGGERS[trigger]


def small_kernel(device: torch.device) -> int:
    """``USE_PDL`` of a kernel that always triggers early (rotary + KV write, norms, router)."""
    return EARLY if mode(device) else OFF


def gemv_trigger(use_pdl: int, weight_bytes: int, norm: bool = False) -> int:
    """``USE_PDL`` of a GEMV streaming ``weight_bytes`` (``norm``: with the add + RMSNorm
    prologue): ``BY_SIZE`` resolved by size, ``AUTO`` likewise except that norm GEMVs trigger
    late."""
    if use_pdl == AUTO and norm:
        return LATE
    if use_pdl in (AUTO, BY_SIZE):
        return EARLY if weight_bytes < EARLY_BYTES else LATE
    return use_pdl


def launch_options(use_pdl: int) -> dict[str, bool]:
    """The Triton launch keyword for a kernel compiled with ``USE_PDL=use_pdl``."""
    return {"launch_pdl": True} if use_pdl else {}
