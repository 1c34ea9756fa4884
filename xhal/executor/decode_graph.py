"""Full-graph decode: persistent inputs, bucket padding, capture on first use, replay after."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from xhal.executor.packed_inputs import PackedInputs
from xhal.executor.staged_table import StagedBlockTable
from xhal.interfaces.metadata import AttentionMetadata, BatchKind

if TYPE_CHECKING:
    from xhal.executor.config import ExecutorConfig
    from xhal.interfaces.attention import AttentionBackend
    from xhal.interfaces.platform import Platform


# Buckets up to this size also capture the LM head over their static output: at a few rows its
# eager launch (GEMM, slice, float cast) costs the host more than the step's other calls do,
# and the logits of larger buckets (float32, vocab wide) would cost more memory than they save
LOGITS_MAX_BUCKET = 8
# (host buffer, batch, route) -> pinned row views kept for reuse; a server's batch sizes bound
# them, and past this many the cache starts over
_MAX_FILLS = 1024


class DecodeGraphs:
    """Captures one decode graph per bucket size and replays it.

    A batch of B decode sequences runs in the smallest bucket >= B. Its live inputs are copied
    into persistent buffers sized for the largest bucket; the B..bucket padding rows carry slot
    -1 (never written) and a 1-token KV length; their token, position and block-table row are
    whatever an earlier step left there (always valid ids), so their outputs are garbage that no
    real row ever reads. A real row's block-table columns past its KV length are not cleared
    either: no backend reads past a sequence's pages. Host ints baked into a graph (num_seqs,
    num_tokens, max_query_len, max_seq_len) are bucket constants, never live values.

    A step queues one device call besides the replay. Its int32 inputs (token ids, positions,
    slots, KV lengths, the block table and its width) are views of one device buffer
    (``packed_inputs.py``): a step handed on the host (CPU tensors, as a host builds it) is
    written into a pinned buffer and crosses in one host-to-device copy, padding rows included,
    all in one call into torch (a multi-tensor copy whose host pairs fill the buffer); one
    already on the device goes in one multi-tensor copy. Token ids handed as ``token_ids(b)``
    itself (where a caller sampling on the device wrote them) are read in place: nothing copies
    them. The graph derives the KV prefix sums (when a backend reads them:
    ``AttentionBackend.reads_kv_cu_seq_lens``) and lays the block table out
    (``staged_table.py``) before its first layer.

    With ``logits`` (hidden ``[N, hidden]`` -> float32 logits of every row), a bucket of at most
    ``LOGITS_MAX_BUCKET`` rows also captures it over the bucket's static output, and
    ``logits_of`` replays that graph for the hidden states ``run`` just returned.
    """

    def __init__(
        self,
        platform: Platform,
        backends: Sequence[AttentionBackend],
        config: ExecutorConfig,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.config, self.backends, self.forward = config, backends, forward
        self.logits = logits
        self.platform = platform
        self.graphs = platform.graph_runner()
        self.sizes = config.decode_capture_sizes
        n, device = self.sizes[-1], platform.device()
        width = config.max_blocks_per_seq
        i32 = dict(dtype=torch.int32, device=device)
        self.packed = PackedInputs(
            {"input_ids": (n,), "positions": (n,), "slot_mapping": (n,), "kv_seq_lens": (n,),
             "table_width": (1,), "block_table": (n * width,)},
            {"slot_mapping": -1, "kv_seq_lens": 1},
            device,
        )  # fmt: skip
        views = self.packed.views
        self.input_ids, self.positions = views["input_ids"], views["positions"]
        self._ids_at = self.input_ids.data_ptr()  # a step's ids that start here are in place
        self._positions_at = self.packed.offsets["positions"]  # where such a step's upload starts
        self.slot_mapping, self.kv_seq_lens = views["slot_mapping"], views["kv_seq_lens"]
        self._table_at = self.packed.offsets["block_table"]  # a step copies up to its table's end
        self._host_live = [0] * self.packed.slots  # per host buffer: rows its last step filled
        self._no_slots = torch.full((n,), -1, **i32)  # what padding rows' slots are reset to
        self.staged_table = StagedBlockTable(views["block_table"], views["table_width"], width)
        self.block_table = self.staged_table.table
        self.q_cu_seq_lens = torch.arange(n + 1, **i32)  # one token per sequence, always
        self.q_seq_lens = torch.ones(n, **i32)
        self.kv_cu_seq_lens = torch.zeros(n + 1, **i32)
        self.q_seq_lens_host = torch.ones(n, dtype=torch.int32)
        self.kv_seq_lens_host = torch.ones(n, dtype=torch.int32)
        self._live = 0  # rows [0, _live) may hold a real row's slot and KV length
        self._kv_host = self.kv_seq_lens_host.numpy()
        self._twin_live = 0  # rows [0, _twin_live) of the host twin may hold a real row's length
        self._width_on_device = -1  # the table width the last step staged (-1: none yet)
        self._bucket_of = [next(s for s in self.sizes if s >= b) for b in range(n + 1)]
        self._rows: dict[int, list[torch.Tensor]] = {}  # b -> views of the first b rows
        self._fills: dict[tuple[int, int, bool], list[torch.Tensor]] = {}  # see _fill_rows
        self._padded: dict[
            int, tuple[AttentionMetadata, torch.Tensor]
        ] = {}  # bucket -> metadata, cu out
        # (bucket, b) -> (the bucket's static output, its first b rows): the view made once
        self._outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._last: tuple[int, torch.Tensor, torch.Tensor] | None = None  # bucket, static, rows
        self._logit_rows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def host_buffers(self) -> list[torch.Tensor]:
        """The host memory a step's staging writes (the pinned ring, the host twin of the KV
        lengths): copies into it are memcpys on the host, never device calls."""
        return [*self.packed.host_buffers, self.kv_seq_lens_host]

    def token_ids(self, n: int) -> torch.Tensor | None:
        """The first ``n`` rows of the graphs' token ids (int32, on the device), or None past
        the largest bucket. A caller that samples on the device may write a step's tokens here
        (in stream order, after the step that produced them): a decode step then handed exactly
        this view (or its first rows) as its ids reads them in place, with no copy. The values
        stay until the next step is queued, whose staging may write these rows."""
        return self.input_ids[:n] if n <= self.sizes[-1] else None

    def bucket_for(self, metadata: AttentionMetadata) -> int | None:
        """The bucket that can run this batch, or None when it must run eagerly."""
        b = metadata.num_seqs
        if (
            metadata.kind != BatchKind.DECODE
            or b > self.sizes[-1]
            or metadata.num_tokens != b
            or metadata.block_table.shape[1] > self.staged_table.max_width
        ):
            return None
        return self._bucket_of[b]

    def _padded_metadata(self, bucket: int) -> tuple[AttentionMetadata, torch.Tensor]:
        """The bucket's metadata (views of the persistent buffers, the same object every step)
        and the view its KV prefix sums are written into."""
        if bucket not in self._padded:
            metadata = AttentionMetadata(
                kind=BatchKind.DECODE,
                num_seqs=bucket,
                num_tokens=bucket,
                max_query_len=1,
                max_seq_len=self.config.max_model_len,
                q_cu_seq_lens=self.q_cu_seq_lens[: bucket + 1],
                kv_cu_seq_lens=self.kv_cu_seq_lens[: bucket + 1],
                q_seq_lens=self.q_seq_lens[:bucket],
                kv_seq_lens=self.kv_seq_lens[:bucket],
                q_seq_lens_host=self.q_seq_lens_host[:bucket],
                kv_seq_lens_host=self.kv_seq_lens_host[:bucket],
                block_table=self.block_table[:bucket],
                slot_mapping=self.slot_mapping[:bucket],
            )
            self._padded[bucket] = metadata, self.kv_cu_seq_lens[1 : bucket + 1]
        return self._padded[bucket]

    def _stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, m: AttentionMetadata, bucket: int
    ) -> AttentionMetadata:
        """Write a step into the persistent inputs with one device call (host time per device
        call is what a graph step spends), padding values (slot -1, one KV token) included in
        rows an earlier, larger step left; the bucket's metadata."""
        b = m.num_seqs
        twin = self._kv_host  # host twin of the KV lengths (numpy: a handful of values)
        if self._from_host(input_ids, positions, m):
            self._stage_host(input_ids, positions, m)  # the twin's rows [0, b) too
        else:
            self._stage_device(input_ids, positions, m)
            twin[:b] = m.kv_seq_lens_host.numpy()
        self._live = b
        if self._twin_live > b:  # its rows past b are 1 but for those a larger step wrote
            twin[b : self._twin_live] = 1
        self._twin_live = b
        padded = self._padded.get(bucket)
        return padded[0] if padded is not None else self._padded_metadata(bucket)[0]

    @staticmethod
    def _from_host(input_ids: torch.Tensor, positions: torch.Tensor, m: AttentionMetadata) -> bool:
        """Whether a step's tensors are host tensors numpy can read (the pinned route); its
        token ids may be on the device (a served step's ids are the tokens the step before
        sampled there): read in place when they are ``token_ids(b)``, copied in after the
        pinned copy otherwise."""
        # is_cpu: a flag read, where .device builds an object (0.15 against 0.8 us here)
        return positions.is_cpu and m.slot_mapping.is_cpu and m.block_table.is_cpu

    @staticmethod
    def _ids_from_host(input_ids: torch.Tensor) -> bool:
        """Whether a host-staged step's token ids go through the pinned buffer too."""
        return input_ids.is_cpu

    def _ids_in_place(self, input_ids: torch.Tensor) -> bool:
        """Whether the step's token ids are ``token_ids(b)`` itself: nothing to stage."""
        return input_ids.data_ptr() == self._ids_at and input_ids.dtype == torch.int32

    def _stage_host(
        self, input_ids: torch.Tensor, positions: torch.Tensor, m: AttentionMetadata
    ) -> None:
        """The next pinned buffer, then its one copy, in one call into torch: the step's rows
        (and the host twin's) as the host pairs of the upload's multi-tensor copy, its table by
        numpy, the ids after the upload when they are on the device. The rows this buffer's own
        last step filled past this step's go back to padding."""
        b = m.num_seqs
        table = m.block_table
        rows, width = table.shape
        packed = self.packed
        host = packed.begin()
        slot = packed.slot
        live = self._host_live[slot]  # rows of this buffer's last step
        if live > b:  # a stale slot could belong to a block since given to another sequence
            host["slot_mapping"][b:live] = -1
            host["kv_seq_lens"][b:live] = 1
        self._host_live[slot] = b
        host["table_width"][0] = width
        # numpy: a table's shape changes too often for views made once (its width grows a page
        # at a time), and one .numpy() costs less than a view
        host["block_table"][: rows * width] = table.numpy().reshape(-1)
        kv = m.kv_seq_lens_host
        end = self._table_at + rows * width
        if self._ids_in_place(input_ids):  # the upload starts past them
            fill = self._fill_rows(slot, b, False)
            sources = [positions, m.slot_mapping, kv, kv]
            packed.upload(end, (fill, sources), start=self._positions_at)
        elif self._ids_from_host(input_ids):
            fill = self._fill_rows(slot, b, True)
            packed.upload(end, (fill, [input_ids, positions, m.slot_mapping, kv, kv]))
        else:  # after the pinned copy in stream order, which carries stale ids
            fill = self._fill_rows(slot, b, False)
            packed.upload(
                end,
                (fill, [positions, m.slot_mapping, kv, kv]),
                (self._row_views(b)[:1], [input_ids]),
            )
        self._width_on_device = width

    def _fill_rows(self, slot: int, b: int, with_ids: bool) -> list[torch.Tensor]:
        """Where a host step's rows go, made once per host buffer, ``b`` and route: the first
        ``b`` values of the pinned buffer's ids (``with_ids``), positions, slots and KV lengths,
        and of the host twin."""
        key = slot, b, with_ids
        fill = self._fills.get(key)
        if fill is None:
            if len(self._fills) >= _MAX_FILLS:
                self._fills.clear()
            host = self.packed.host_tensors[slot]
            names = ("input_ids",) * with_ids + ("positions", "slot_mapping", "kv_seq_lens")
            fill = self._fills[key] = [host[n][:b] for n in names] + [self.kv_seq_lens_host[:b]]
        return fill

    def _stage_device(
        self, input_ids: torch.Tensor, positions: torch.Tensor, m: AttentionMetadata
    ) -> None:
        """One multi-tensor copy of device tensors: the step's rows, its table (and its width
        when the last step staged another), and the padding values back into rows an earlier,
        larger step left."""
        b = m.num_seqs
        width = m.block_table.shape[1]
        table_dst, table_src = self.staged_table.pairs(
            m.block_table, with_width=width != self._width_on_device
        )
        dst = [*self._row_views(b), *table_dst]
        src = [input_ids, positions, m.slot_mapping, m.kv_seq_lens, *table_src]
        if self._ids_in_place(input_ids):
            del dst[0], src[0]
        if self._live > b:  # a stale slot could belong to a block since given to another sequence
            stale = self._live - b
            dst += [self.slot_mapping[b : self._live], self.kv_seq_lens[b : self._live]]
            src += [self._no_slots[:stale], self.q_seq_lens[:stale]]  # q_seq_lens: all ones
        torch._foreach_copy_(dst, src, non_blocking=True)
        self._width_on_device = width

    def _row_views(self, b: int) -> list[torch.Tensor]:
        """The first ``b`` rows of the ids, positions, slots and KV lengths, made once per b."""
        rows = self._rows.get(b)
        if rows is None:
            rows = self._rows[b] = [
                self.input_ids[:b], self.positions[:b], self.slot_mapping[:b], self.kv_seq_lens[:b]
            ]  # fmt: skip
        return rows

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        bucket: int,
    ) -> torch.Tensor:
        """Hidden states of the real rows; a view of the graph's static output, valid until the
        next step."""
        padded = self._stage(input_ids, positions, metadata, bucket)
        key = ("decode", bucket)
        for backend in self.backends:
            backend.plan(padded, graph_key=key)
        if key not in self.graphs:
            ids, pos = self.input_ids[:bucket], self.positions[:bucket]
            kv_cu = self._padded_metadata(bucket)[1]
            # the KV prefix sums only for a backend that reads them: two kernels a step on CUDA
            derive_cu = any(backend.reads_kv_cu_seq_lens for backend in self.backends)

            def step() -> torch.Tensor:  # what the host stages raw is derived inside the graph
                if derive_cu:
                    torch.cumsum(padded.kv_seq_lens, 0, dtype=torch.int32, out=kv_cu)
                self.staged_table.lay_out(bucket)
                return self.forward(ids, pos, padded)

            self.graphs.capture(key, step)
        for backend in self.backends:
            backend.before_replay(key)
        static = self.graphs.replay(key)
        cached = self._outputs.get((bucket, metadata.num_seqs))
        if cached is None or cached[0] is not static:  # a recapture makes a new static output
            b = metadata.num_seqs
            cached = self._outputs[bucket, b] = static, static[:b]
        self._last = bucket, static, cached[1]
        return cached[1]

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits ``[b, vocab]`` of ``hidden`` by the bucket's captured LM head, when
        ``hidden`` is what ``run`` last returned and its bucket is small; None otherwise. A view
        of the graph's static output, valid until the next step."""
        last = self._last
        if self.logits is None or last is None or hidden is not last[2]:
            return None
        bucket, static, rows = last
        if bucket > LOGITS_MAX_BUCKET:
            return None
        key = ("logits", bucket)
        if key not in self.graphs:
            logits = self.logits
            self.graphs.capture(key, lambda: logits(static))
        out = self.graphs.replay(key)
        b = rows.shape[0]
        cached = self._logit_rows.get((bucket, b))
        if cached is None or cached[0] is not out:
            cached = self._logit_rows[bucket, b] = out, out[:b]
        return cached[1]

    def capture_all(self, progress: bool = True) -> dict[str, float]:
        """Capture every bucket up front (largest first, as the shared pool prefers) with dummy
        steps whose rows all carry slot -1, so no cache is written. Returns time and memory."""
        import logging
        import time

        from tqdm import tqdm

        device, i32 = self.input_ids.device, dict(dtype=torch.int32)
        free_before = self._free_memory()
        start = time.perf_counter()
        for bucket in tqdm(
            sorted(self.sizes, reverse=True), desc="capturing decode graphs", disable=not progress
        ):
            ones = torch.ones(bucket, **i32)
            dummy = AttentionMetadata.from_host_lengths(
                BatchKind.DECODE,
                ones,
                ones.clone(),
                torch.zeros(bucket, 1, **i32).to(device),
                torch.full((bucket,), -1, **i32).to(device),
            )
            zeros = torch.zeros(bucket, **i32).to(device)
            self.logits_of(self.run(zeros, zeros, dummy, bucket))  # captures the LM head too
        self.platform.synchronize()
        stats = {"seconds": time.perf_counter() - start, "graphs": len(self.sizes)}
        if free_before is not None:
            stats["memory_bytes"] = free_before - self._free_memory()
        logging.getLogger(__name__).info(
            "captured %d decode graphs in %.1f s, %s",
            stats["graphs"],
            stats["seconds"],
            f"{stats['memory_bytes'] / 2**20:.0f} MiB"
            if "memory_bytes" in stats
            else "memory not reported",
        )
        return stats

    def _free_memory(self) -> int | None:
        # with the allocator's unused blocks given back first: the graph warm-ups' own
        # allocations (a kernel choice timed on weight copies) would otherwise count on
        # whichever side of the captures still held them, and capture itself empties the cache
        self.platform.empty_cache()
        try:
            return self.platform.mem_get_info()[0]
        except NotImplementedError:
            return None

    def reset(self) -> None:
        self.graphs.reset()
        self._outputs.clear()
        self._logit_rows.clear()
        self._last = None
