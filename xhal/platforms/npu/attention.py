"""NPU attention: one ``npu_fused_infer_attention_score`` (FIA) call in TND layout over the paged
cache for every batch kind, after a paged KV write (``npu_scatter_pa_kv_cache``, cache_mode "Norm").

``plan`` turns the step's host lengths into the Python int lists FIA takes (the schema's
``SymInt[]? actual_seq_lengths``; vllm-ascend's metadata builder does the same, once per step). In a
captured graph those lists are baked, so each layer's FIA is captured as a task group and re-issued
with the new lists on the update stream before every replay (``graph_task_group_begin/end`` and
``graph_task_update_begin/end`` of the wheel's ``torch_npu/npu/graphs.py``, used as vllm-ascend's
``update_graph_params`` does). Every FIA rule quoted here is from the op's documentation in the
torch-npu wheel, collected in docs/npu-ops.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from xhal.interfaces.attention import AttentionBackend, AttentionSpec
from xhal.interfaces.cache import LayerCache, normalize_layer_caches
from xhal.interfaces.metadata import AttentionMetadata
from xhal.platforms.common.persistent import PersistentInputs
from xhal.platforms.npu.kernels.kv_write import KV_WRITERS, pick_kv_writer

# FIA sparse_mode: '为3时, 代表rightDownCausal模式的mask, 对应以右顶点为划分的下三角场景'
# (bottom-right aligned causal, what chunked prefill needs); '为4时, 代表band模式的mask'
SPARSE_CAUSAL = 3
SPARSE_BAND = 4
# '当Query矩阵的S为1, 进入IncreFlashAttention分支, 其余场景进入PromptFlashAttention分支': a
# 2-token dummy sequence keeps a windowed decode batch on the prompt branch, where the band applies
DUMMY_Q_LEN = 2
KV_LAYOUTS = ("NHD", "HND")  # [nb, bs, Hkv, D] as (blocknum, blocksize, H); [nb, Hkv, bs, D]


@dataclass
class FiaPlan:
    """One step's FIA arguments, shared by every layer."""

    # TND: '每个元素的值表示当前Batch与之前所有Batch的seqlen和' (cumulative q lengths)
    actual_seq_lengths: list[int]
    # page attention: '在PA场景下, 其长度等于key/value的Batch值, 代表每个Batch的实际长度'
    actual_seq_lengths_kv: list[int]
    block_table: torch.Tensor  # int32 [B, max_blocks]
    slot_mapping: torch.Tensor  # int32 [T]
    dummy_rows: int = 0  # query rows of a trailing dummy sequence (sliding-window decode)
    graph_key: Hashable | None = None
    captured: PersistentInputs | None = None  # a graph plan's persistent metadata tensors

    @property
    def num_query_rows(self) -> int:
        """Rows FIA computes: the query's T must equal ``actual_seq_lengths[-1]`` under TND (the
        meta function sizes the output by the query; hardware answers error 561002 otherwise)."""
        return self.actual_seq_lengths[-1] if self.actual_seq_lengths else 0

    @property
    def num_real_tokens(self) -> int:
        return self.num_query_rows - self.dummy_rows


@dataclass
class CapturedFia:
    """One layer's FIA captured as a task group: what re-issuing it with new lengths needs."""

    handle: Any  # torch_npu._C._NPUTaskGroupHandle
    event: Any  # torch.npu.ExternalEvent gating the captured call on its update
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor
    softmax_lse: torch.Tensor
    workspace: torch.Tensor


class NpuAttention(AttentionBackend):
    reads_kv_cu_seq_lens = False

    def __init__(
        self,
        spec: AttentionSpec,
        torch_npu: ModuleType,
        mask: torch.Tensor,
        update_stream: Any,
        kv_writer: str | None = None,
        kv_layout: str = "NHD",
    ) -> None:
        super().__init__(spec)
        self.npu, self.mask, self.update_stream = torch_npu, mask, update_stream
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout {kv_layout!r}: the NPU backend runs on {KV_LAYOUTS}")
        self.kv_layout = kv_layout
        if kv_layout == "HND":  # the scatter_pa / ATB writers take NHD caches only
            kv_writer = kv_writer or "scatter_nd_hnd"
            if kv_writer != "scatter_nd_hnd":
                raise ValueError(f"kv_writer {kv_writer!r} cannot write an HND cache")
        self.kv_writer = kv_writer or pick_kv_writer(torch_npu)
        self._write = KV_WRITERS[self.kv_writer]
        self._caches: list[LayerCache] = []
        self._plan: FiaPlan | None = None
        self._graph_plans: dict[Hashable, FiaPlan] = {}
        self._captured: dict[Hashable, dict[int, CapturedFia]] = {}
        self._workspaces: dict[Hashable, torch.Tensor] = {}

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        s = self.spec
        if self.kv_layout == "HND":  # FIA's (blocknum, KV_N, blocksize, D)
            return (num_blocks, s.num_kv_heads, s.block_size, s.head_dim)
        return super().kv_cache_shape(num_blocks)

    def bind_kv_caches(self, caches: Sequence[LayerCache]) -> None:
        self._caches = normalize_layer_caches(caches)

    # planning ----------------------------------------------------------------------------------

    def plan(self, metadata: AttentionMetadata, graph_key: Hashable | None = None) -> None:
        # host tensors only: no device sync (ARCHITECTURE.md, the step contract)
        q_lens = metadata.q_seq_lens_host.tolist()
        cumulative = list(itertools.accumulate(q_lens))
        kv_lens = metadata.kv_seq_lens_host.tolist()
        table, dummy_rows = metadata.block_table, 0
        if self.spec.sliding_window is not None and max(q_lens, default=0) == 1:
            # FIA's doc: sparse_mode 'Q_S为1且不带rope输入时该参数无效' and pre_tokens 'Q_S为1时
            # 该参数无效': a dummy 2-token sequence over block 0 keeps the band mask in force
            dummy_rows = DUMMY_Q_LEN
            cumulative.append(cumulative[-1] + dummy_rows)
            kv_lens.append(dummy_rows)
            table = torch.cat([table, table.new_zeros(1, table.shape[1])])
        if graph_key is None:
            self._plan = FiaPlan(cumulative, kv_lens, table, metadata.slot_mapping, dummy_rows)
            return
        # a captured bucket reads the executor's persistent tensors in place (the graph-key policy
        # of AttentionBackend); only a dummy row's table is the bucket's own, refreshed from them
        static = self._graph_plans.get(graph_key)
        if static is None:
            captured = PersistentInputs(graph_key, metadata.block_table, metadata.slot_mapping)
            static = FiaPlan(
                cumulative, kv_lens, table, metadata.slot_mapping, dummy_rows, graph_key, captured
            )
            self._graph_plans[graph_key] = static
        else:
            static.captured.check(metadata.block_table, metadata.slot_mapping)
            if dummy_rows != static.dummy_rows:
                raise ValueError(
                    f"graph bucket {graph_key!r} was captured with {static.dummy_rows} dummy rows, "
                    f"now {dummy_rows}: a bucket keeps its batch kind"
                )
            if dummy_rows:
                static.block_table[:-1].copy_(metadata.block_table, non_blocking=True)
            static.actual_seq_lengths, static.actual_seq_lengths_kv = cumulative, kv_lens
        self._plan = static

    def _fia_kwargs(self, plan: FiaPlan) -> dict[str, Any]:
        s = self.spec
        kwargs: dict[str, Any] = dict(
            num_heads=s.num_heads,
            num_key_value_heads=s.num_kv_heads,
            input_layout="TND",
            # the schema's default is 1.0 ('用户不特意指定时可传入默认值1.0')
            scale=s.softmax_scale,
            block_table=plan.block_table,
            block_size=s.block_size,
            actual_seq_lengths=plan.actual_seq_lengths,
            actual_seq_lengths_kv=plan.actual_seq_lengths_kv,
            # 'sparse_mode=2、3、4时, atten_mask的shape需要为(S, S)... S的值需要固定为2048'
            atten_mask=self.mask,
            sparse_mode=SPARSE_CAUSAL,
        )
        if s.sliding_window is not None:
            # band: pre_tokens '表示attention需要和前几个Token计算关联' counts the keys before the
            # query, so W keys including the query itself are pre_tokens = W - 1, next_tokens = 0
            kwargs.update(sparse_mode=SPARSE_BAND, pre_tokens=s.sliding_window - 1, next_tokens=0)
        return kwargs

    # the step ----------------------------------------------------------------------------------

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("NpuAttention.forward called before plan(metadata)")
        cache = self._caches[layer_id]
        self._write(self.npu, k, v, cache, plan.slot_mapping)
        # TND takes '(blocknum, blocksize, H)和(blocknum, KV_N, blocksize, D)两种格式': NHD is the
        # first by a free view, HND is the second as it is
        key, value = cache.key, cache.value
        if self.kv_layout == "NHD":
            num_blocks, block_size = cache.key.shape[:2]
            key = key.view(num_blocks, block_size, -1)
            value = value.view(num_blocks, block_size, -1)
        # TND needs query.shape[0] == actual_seq_lengths[-1]: drop the trailing padding rows
        # (vllm-ascend slices query[:num_tokens] the same way)
        n = plan.num_real_tokens
        query = q[:n].contiguous()  # [n, H, D]
        if plan.dummy_rows:
            query = torch.cat([query, query.new_zeros(plan.dummy_rows, *query.shape[1:])])
        if plan.graph_key is None:
            kwargs = self._fia_kwargs(plan)
            out, _ = self.npu.npu_fused_infer_attention_score(query, key, value, **kwargs)
        else:
            out = self._capture(layer_id, plan, query, key, value)
        out = out[:n]
        if n == q.shape[0]:
            return out
        return torch.cat([out, out.new_zeros(q.shape[0] - n, *out.shape[1:])])  # padding rows: 0

    # graphs ------------------------------------------------------------------------------------

    def _capture(
        self,
        layer_id: int,
        plan: FiaPlan,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        """FIA under graph capture, as vllm-ascend's ``full_graph_fia``: an event the update
        will record, then the ``.out`` overload (the schema's ``Tensor? workspace=None`` plus the
        two outputs) alone in a task group."""
        npu, kwargs = self.npu, self._fia_kwargs(plan)
        stream = torch.npu.current_stream()
        workspace = self._workspaces.get(plan.graph_key)
        if workspace is None:  # the "max" workspace: sized so any later update fits
            get_workspace = npu._npu_fused_infer_attention_score_get_max_workspace
            workspace = get_workspace(query, key, value, **kwargs)
            self._workspaces[plan.graph_key] = workspace
        output = torch.empty_like(query)
        # softmax_lse_flag=False: the doc's "shape为[1]的值为0的Tensor", dtype "float32"
        softmax_lse = torch.empty(1, dtype=torch.float32, device=query.device)
        event = torch.npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        # only FIA inside the group: HCCL in a task group fails capture (vllm-ascend #13688)
        torch.npu.graph_task_group_begin(stream)
        npu.npu_fused_infer_attention_score.out(
            query, key, value, workspace=workspace, out=[output, softmax_lse], **kwargs
        )
        handle = torch.npu.graph_task_group_end(stream)
        captured = CapturedFia(handle, event, query, key, value, output, softmax_lse, workspace)
        self._captured.setdefault(plan.graph_key, {})[layer_id] = captured
        return output

    def before_replay(self, graph_key: Hashable) -> None:
        """Re-issue every captured FIA of ``graph_key`` with the lengths of the latest
        ``plan(..., graph_key)``, on the update stream, then release its event."""
        captured = self._captured.get(graph_key)
        if not captured:
            return
        plan, stream = self._graph_plans[graph_key], self.update_stream
        kwargs = self._fia_kwargs(plan)
        # after the previous replay (whose tasks these updates rewrite) and this step's copies
        stream.wait_stream(torch.npu.current_stream())
        with torch.npu.stream(stream):
            for layer_id, c in captured.items():
                if c.query.shape[0] != plan.num_query_rows:
                    raise ValueError(
                        f"graph {graph_key!r} captured {c.query.shape[0]} query rows for layer "
                        f"{layer_id}, the new plan has {plan.num_query_rows}: a bucket keeps its "
                        "shape"
                    )
                torch.npu.graph_task_update_begin(stream, c.handle)
                self.npu.npu_fused_infer_attention_score.out(
                    c.query,
                    c.key,
                    c.value,
                    workspace=c.workspace,
                    out=[c.output, c.softmax_lse],
                    **kwargs,
                )
                torch.npu.graph_task_update_end(stream)
                c.event.record(stream)
