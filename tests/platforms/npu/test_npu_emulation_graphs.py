"""The torch_npu emulation's graphs: a captured FIA keeps the lengths it saw until a task-group
update (manual, vllm-ascend's ExternalEvent order, or ``auto_dispatch_capture``) re-issues it, and
capture refuses what the real runtime cannot replay (host syncs, FIA wrapped in another custom op,
collectives inside a task group, a misused update protocol).

Outputs are checked against the float64 attention reference in npu_emulation_helpers.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.npu_emulation_helpers import (
    BF16,
    TOL,
    call_fia,
    emulated_npu,
    fia_kwargs,
    flat,
    make_batch,
    max_err,
    reference,
)

npu = emulated_npu  # the fixture, under the name the tests take


def decode_setup(npu):
    b = make_batch([1, 1], [130, 50], seed=7)
    q = b.q.clone()  # the graph's static input
    return b, q


def eager(npu, b, q, kv_lens):
    return call_fia(npu, b, q=q, actual_seq_lengths_kv=kv_lens)


def next_step(b, q):
    q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(BF16))
    return [n + 1 for n in b.kv_lens]


def test_graph_bakes_lengths_and_manual_update_fixes_them(npu):
    b, q = decode_setup(npu)
    g, host_lens = torch.npu.NPUGraph(), list(b.kv_lens)
    with torch.npu.graph(g, pool=torch.npu.graph_pool_handle()):
        s = torch.npu.current_stream()
        torch.npu.graph_task_group_begin(s)
        out = eager(npu, b, q, host_lens)
        handle = torch.npu.graph_task_group_end(s)
        doubled = out * 2  # work after attention replays too
    assert max_err(out, reference(b, q=q)) < TOL
    new_lens = next_step(b, q)
    host_lens[:] = new_lens  # mutating the host list the capture saw changes nothing either
    g.replay()  # no update: stale lengths
    assert torch.equal(out, eager(npu, b, q, b.kv_lens))
    assert max_err(out, reference(b, q=q, kv_lens=new_lens)) > 10 * TOL
    update_stream = torch.npu.Stream()
    with torch.npu.stream(update_stream):
        torch.npu.graph_task_update_begin(update_stream, handle)
        eager(npu, b, q, new_lens)  # re-issued, not run
        torch.npu.graph_task_update_end(update_stream)
    g.replay()
    assert torch.equal(out, eager(npu, b, q, new_lens)) and torch.equal(doubled, out * 2)
    assert max_err(out, reference(b, q=q, kv_lens=new_lens)) < TOL


def test_graph_vllm_ascend_order_out_variant_with_external_event(npu):
    b, q = decode_setup(npu)
    out, lse = torch.empty_like(q), torch.empty(1)
    g, event = torch.npu.NPUGraph(), torch.npu.ExternalEvent()

    def fia_out(kv_lens):
        npu.npu_fused_infer_attention_score.out(
            q, flat(b.k), flat(b.v), out=[out, lse],
            **fia_kwargs(b, actual_seq_lengths_kv=kv_lens),
        )

    with torch.npu.graph(g):
        s = torch.npu.current_stream()
        event.wait(s)
        event.reset(s)
        torch.npu.graph_task_group_begin(s)
        fia_out(b.kv_lens)
        handle = torch.npu.graph_task_group_end(s)
    new_lens = next_step(b, q)
    g.replay()  # parks at the captured event.wait
    with pytest.raises(RuntimeError, match="hang"):
        torch.npu.synchronize()
    update_stream = torch.npu.Stream()
    with torch.npu.stream(update_stream):
        torch.npu.graph_task_update_begin(update_stream, handle)
        fia_out(new_lens)
        torch.npu.graph_task_update_end(update_stream)
        event.record(update_stream)  # the replay resumes with the new lengths
    torch.npu.synchronize()
    assert max_err(out, reference(b, q=q, kv_lens=new_lens)) < TOL


def test_graph_auto_dispatch_capture_update(npu):
    b, q = decode_setup(npu)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        out = eager(npu, b, q, b.kv_lens)
    new_lens = next_step(b, q)
    g.replay()  # without update the replay waits on its event forever
    with pytest.raises(RuntimeError, match="hang"):
        torch.npu.synchronize()
    with pytest.raises(RuntimeError, match="blocked"):
        g.replay()  # queued behind the blocked one
    g.reset()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        out = eager(npu, b, q, b.kv_lens)
    g.update(cpu_update_input=[{"actual_seq_lengths_kv": new_lens}])
    g.replay()
    torch.npu.synchronize()
    assert max_err(out, reference(b, q=q, kv_lens=new_lens)) < TOL
    with pytest.raises(TypeError, match="not Tensor"):
        g.update(cpu_update_input=[{"actual_seq_lengths_kv": torch.tensor(new_lens)}])
    with pytest.raises(RuntimeError, match="PER-SEQUENCE"):
        g.update(cpu_update_input=[{"actual_seq_lengths_kv": [130, 131 + 500]}])


def test_graph_update_protocol_misuse_raises(npu):
    b, q = decode_setup(npu)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        s = torch.npu.current_stream()
        torch.npu.graph_task_group_begin(s)
        eager(npu, b, q, b.kv_lens)
        handle = torch.npu.graph_task_group_end(s)
    with pytest.raises(RuntimeError, match="differ from the capture stream"):
        torch.npu.graph_task_update_begin(s, handle)
    update_stream = torch.npu.Stream()
    torch.npu.graph_task_update_begin(update_stream, handle)
    eager(npu, b, q, b.kv_lens)  # issued on the current stream, not the update stream
    with pytest.raises(RuntimeError, match="re-issue the same ops"):
        torch.npu.graph_task_update_end(update_stream)
    with pytest.raises(RuntimeError, match="auto_dispatch_capture"):
        g.update(cpu_update_input=[{"actual_seq_lengths_kv": b.kv_lens}])
    with pytest.raises(RuntimeError, match="default stream"):
        torch.npu.NPUGraph().capture_begin()
    with pytest.raises(RuntimeError, match="host"):
        with torch.npu.graph(torch.npu.NPUGraph()):
            q.sum().item()


_WRAPPED: dict[str, object] = {}


@torch.library.custom_op("npu_emu_test::wrapped_fia", mutates_args=())
def _wrapped_fia(q: torch.Tensor) -> torch.Tensor:
    npu, b = _WRAPPED["npu"], _WRAPPED["batch"]
    return call_fia(npu, b, q=q)


def test_fia_inside_another_custom_op_refused_under_capture(npu):
    b, q = decode_setup(npu)
    _WRAPPED.update(npu=npu, batch=b)
    assert max_err(_wrapped_fia(q), reference(b, q=q)) < TOL  # eager is fine
    with pytest.raises(RuntimeError, match="called inside another op"):
        with torch.npu.graph(torch.npu.NPUGraph()):
            _wrapped_fia(q)


def test_collective_inside_task_group_raises(npu, tmp_path):
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                                world_size=1)
    try:
        x = torch.ones(4)
        with pytest.raises(RuntimeError, match="never put a collective inside a task group"):
            with torch.npu.graph(torch.npu.NPUGraph()):
                torch.npu.graph_task_group_begin(torch.npu.current_stream())
                dist.all_reduce(x)
        with torch.npu.graph(torch.npu.NPUGraph()):  # outside a task group it is captured
            dist.all_reduce(x)
    finally:
        if created:
            dist.destroy_process_group()
