"""The hardware-neutral model executor: one ``execute`` per step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from xhal.executor.config import ExecutorConfig
from xhal.executor.decode_graph import DecodeGraphs
from xhal.executor.host_step import on_device
from xhal.executor.kv_cache import allocate_kv_caches, num_blocks_for_budget
from xhal.executor.layer_sync import LayerSynchronizer, record_every_layer, recording_layers
from xhal.executor.piecewise import PiecewiseGraphs
from xhal.interfaces.attention import AttentionBackend, AttentionSpec
from xhal.interfaces.cache import LayerCache, normalize_layer_caches
from xhal.interfaces.collective import Collective
from xhal.interfaces.forward_context import ForwardContext, forward_context
from xhal.interfaces.metadata import AttentionMetadata, BatchKind
from xhal.interfaces.platform import Platform
from xhal.layers.attention import attention_layers


class ModelExecutor:
    """Runs a model on a platform, one step per ``execute`` call (ARCHITECTURE.md section 2).

    It owns the attention backends (one per distinct ``AttentionSpec``), the persistent inputs
    and padding of captured graphs, and the runners; the model only holds weights and forward.
    """

    def __init__(
        self,
        model: nn.Module,
        platform: Platform,
        config: ExecutorConfig | None = None,
        collective: Collective | None = None,
    ) -> None:
        self.model, self.platform = model, platform
        platform.prepare_weights(model)
        self.config = config or ExecutorConfig()
        self.collective = collective or platform.collective(None)
        self._attention_layers = attention_layers(model)
        self.specs = self._attention_specs()
        by_spec: dict[AttentionSpec, AttentionBackend] = {}
        self.backend_of: dict[int, AttentionBackend] = {}
        for layer_id, spec in self.specs.items():
            if spec not in by_spec:
                by_spec[spec] = platform.attention_backend(spec)
            self.backend_of[layer_id] = by_spec[spec]
        self.backends = list(by_spec.values())
        self.hidden_size = self._hidden_size(model)
        self._caches_bound = False
        self._num_blocks = 0
        self.decode_graphs = self.piecewise = None
        if not self.config.enforce_eager and platform.capabilities.graphs:
            # the LM head in the small buckets' graphs too, unless it gathers over ranks
            logits = self._logits if self.collective.world_size == 1 else None
            self.decode_graphs = DecodeGraphs(
                platform, self.backends, self.config, self._forward, logits
            )
            if self.config.token_capture_sizes:
                self.piecewise = PiecewiseGraphs(
                    platform, self.backend_of, self.backends, self.config, self._forward_with
                )

    # setup -------------------------------------------------------------------------------------

    def _attention_specs(self) -> dict[int, AttentionSpec]:
        cfg = self.config
        return {a.layer_id: a.spec(cfg.dtype, cfg.block_size) for a in self._attention_layers}

    @staticmethod
    def _hidden_size(model: nn.Module) -> int:
        config = getattr(model, "config", None)
        size = (
            config.get("hidden_size")
            if isinstance(config, dict)
            else getattr(config, "hidden_size", None)
        )
        if size is None:
            raise ValueError("the model needs a .config with hidden_size")
        return int(size)

    # KV caches ---------------------------------------------------------------------------------

    def allocate_kv_caches(
        self, num_blocks: int | None = None, memory_bytes: int | None = None
    ) -> list[LayerCache]:
        """Allocate zeroed caches for every layer, by block count or by a byte budget."""
        if (num_blocks is None) == (memory_bytes is None):
            raise ValueError("give exactly one of num_blocks or memory_bytes")
        if num_blocks is None:
            num_blocks = num_blocks_for_budget(self.specs, memory_bytes)
        return allocate_kv_caches(self.specs, num_blocks, self.platform.device())

    def bind_kv_caches(self, caches: Sequence[Any]) -> None:
        """Bind the per-layer caches once (``LayerCache``, ``(k, v)`` or xLLM's 6-tuples)."""
        if self._caches_bound:
            raise RuntimeError("KV caches are bound once; build a new executor to rebind")
        caches = normalize_layer_caches(caches)
        if len(caches) != len(self.specs):
            raise ValueError(
                f"got {len(caches)} layer caches, the model has {len(self.specs)} attention layers"
            )
        for layer_id, cache in enumerate(caches):
            spec = self.specs[layer_id]
            expected = self.backend_of[layer_id].kv_cache_shape(cache.num_blocks)
            if tuple(cache.key.shape) != expected or cache.key.dtype != spec.dtype:
                raise ValueError(
                    f"layer {layer_id} cache is {tuple(cache.key.shape)} {cache.key.dtype}; "
                    f"expected {expected} {spec.dtype}"
                )
        for backend in self.backends:
            backend.bind_kv_caches(caches)
        self._num_blocks = caches[0].num_blocks
        self._caches_bound = True

    def capture_graphs(self, progress: bool = True) -> dict[str, float]:
        """Capture every decode bucket now rather than on first use; logs and returns the time and
        device memory it took. A no-op (empty stats) when graphs are off."""
        if self.decode_graphs is None:
            return {}
        if not self._caches_bound:
            raise RuntimeError("bind_kv_caches(...) must be called before capture_graphs()")
        return self.decode_graphs.capture_all(progress)

    def warm_up(self, num_tokens: int | None = None) -> float:
        """Run one prefill of ``num_tokens`` (default: the batched-token budget, at most
        ``max_model_len``) whose KV writes all go to slot -1, so the caches are untouched: JIT
        compilation and lazy initialization (attention prefill modules, kernels at large row
        counts, piecewise graphs) happen now rather than in the first request. Returns seconds."""
        import time

        if not self._caches_bound:
            raise RuntimeError("bind_kv_caches(...) must be called before warm_up()")
        cfg = self.config
        n = min(num_tokens or cfg.max_num_batched_tokens, cfg.max_model_len)
        pages = -(-n // cfg.block_size)
        device, i32 = self.platform.device(), dict(dtype=torch.int32)
        lens = torch.tensor([n], **i32)
        metadata = AttentionMetadata.from_host_lengths(
            BatchKind.PREFILL,
            lens,
            lens.clone(),
            (torch.arange(pages, **i32) % self._num_blocks)[None].to(device),  # read only
            torch.full((n,), -1, **i32).to(device),
        )
        start = time.perf_counter()
        tokens = torch.zeros(n, **i32).to(device)
        hidden = self.execute(tokens, torch.arange(n, **i32).to(device), metadata)
        self.compute_logits(hidden, torch.tensor([n - 1]))
        self.platform.synchronize()
        return time.perf_counter() - start

    # one step ----------------------------------------------------------------------------------

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        input_embedding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._forward_with(input_ids, positions, metadata, self.backend_of, input_embedding)

    def _forward_with(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        attention: Mapping[int, Any],
        input_embedding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        with forward_context(ForwardContext(metadata, attention, self.collective)):
            return self.model(input_ids, positions, input_embedding)

    def execute(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: Any,
        input_embedding: torch.Tensor | None = None,
        layer_synchronizer: LayerSynchronizer | None = None,
    ) -> torch.Tensor:
        """Run one step and return hidden states ``[T, hidden]``.

        ``metadata`` is an ``AttentionMetadata`` or an xLLM metadata view (object or dict) in
        ``config.metadata_convention``, normalized by ``xhal.adapter``. The result may be a view
        of a graph's static output: consume it before the next ``execute``. A
        ``layer_synchronizer`` gets ``record_event(layer_id)`` once per attention layer, in layer
        order, as each finishes (eager) or after the replay (graphs): see ``layer_sync``.
        """
        if not self._caches_bound:
            raise RuntimeError("bind_kv_caches(...) must be called before execute(...)")
        if not isinstance(metadata, AttentionMetadata):
            from xhal.adapter.from_xllm import from_xllm

            metadata = from_xllm(metadata, self.config.metadata_convention)
        if metadata.kind == BatchKind.EMPTY or metadata.num_tokens == 0:
            return torch.empty(
                0, self.hidden_size, dtype=self.config.dtype, device=self.platform.device()
            )
        # the decode graphs take a step's tensors on the host or the device
        hidden = self._run_graphs(
            self.decode_graphs, input_ids, positions, metadata, input_embedding
        )
        if hidden is None:  # the other runners read device tensors: a host-built step moves
            input_ids, positions, metadata = on_device(
                input_ids, positions, metadata, self.platform.device()
            )
            hidden = self._run_graphs(
                self.piecewise, input_ids, positions, metadata, input_embedding
            )
        if hidden is not None:
            if layer_synchronizer is not None:  # a graph finishes every layer at once
                record_every_layer(self._attention_layers, layer_synchronizer)
            return hidden
        for backend in self.backends:
            backend.plan(metadata)
        if layer_synchronizer is None:
            return self._forward(input_ids, positions, metadata, input_embedding)
        with recording_layers(self._attention_layers, layer_synchronizer):
            return self._forward(input_ids, positions, metadata, input_embedding)

    @staticmethod
    def _run_graphs(
        graphs: DecodeGraphs | PiecewiseGraphs | None,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        input_embedding: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The step on ``graphs`` (full-graph decode, or piecewise prefill / mixed) when one of
        its buckets fits; None means another runner."""
        if input_embedding is not None or graphs is None:
            return None
        bucket = graphs.bucket_for(metadata)
        if bucket is None:
            return None
        return graphs.run(input_ids, positions, metadata, bucket)

    def token_ids(self, n: int) -> torch.Tensor | None:
        """Where a caller that samples on the device may write the ``n`` tokens the next decode
        step reads (int32 ``[n]``, on the device), or None when no decode graph could read
        them there (graphs off, or more rows than the largest bucket). A step handed this view
        as its ids runs without copying them; any other step may take it like any ids. Write
        it after the step that produced the tokens (in stream order); its values last until
        the next step is queued."""
        return None if self.decode_graphs is None else self.decode_graphs.token_ids(n)

    def compute_logits(
        self, hidden: torch.Tensor, selected_idxes: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float32 logits ``[S, vocab]`` of the rows ``selected_idxes`` (all rows when None).
        For every row of a small graph decode step this replays the LM head captured with the
        bucket: the result is then a view of a static output, valid until the next step."""
        if selected_idxes is None and self.decode_graphs is not None:
            logits = self.decode_graphs.logits_of(hidden)
            if logits is not None:
                return logits
        if selected_idxes is not None:
            hidden = hidden.index_select(0, selected_idxes.to(hidden.device, torch.long))
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with forward_context(ForwardContext(None, {}, self.collective)):
            return self.model.compute_logits(hidden).float()
