"""What every tensor-parallel rank builds and runs the same way: its shard of the model in an
executor, and one step's forward. Rank 0 (``ModelRunner``) and the workers (``tp_worker``) share
these, so the ranks cannot drift apart."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from serve_cli.engine.config import EngineConfig
    from serve_cli.engine.runner.input_builder import ModelInput
    from serve_cli.engine.served_model import ServedModel
    from xhal.executor import ModelExecutor
    from xhal.interfaces.collective import Collective
    from xhal.interfaces.platform import Platform
    from xhal.layers import TensorParallel


def build_executor(
    platform: Platform,
    served: ServedModel,
    config: EngineConfig,
    tp: TensorParallel,
    collective: Collective | None = None,
    progress: bool = True,
) -> ModelExecutor:
    """Load this rank's shard (``tp``) of ``served`` (from its config.json as read once, not
    from the file again) onto the platform's current device and wrap it in the executor every
    rank configures identically; the xLLM layout is the platform's ``metadata_convention``."""
    from models.loader import load_model
    from xhal.executor import ExecutorConfig, ModelExecutor

    model = load_model(
        served.directory, config.dtype, platform.device(), tp=tp, config=served.hf_config,
        progress=progress, load_format=config.load_format,
    )
    return ModelExecutor(
        model,
        platform,
        ExecutorConfig(
            dtype=next(model.parameters()).dtype,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=served.max_model_len,
            enforce_eager=config.runs_eager,
            metadata_convention=platform.metadata_convention,
        ),
        collective,
    )


def forward(
    executor: ModelExecutor, inputs: ModelInput
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One ``execute``, then float32 logits ``[S, vocab]`` of the sampled rows (None when the
    step samples nothing) and ``[P, vocab]`` of the scored prompt rows (None when none). With
    tensor parallelism every rank must call this with the same inputs: both calls run
    collectives. On a CPU platform the step runs in inference mode
    (serving never differentiates): every torch call then skips autograd's dispatch and version
    counting, about 6% of an eager SmolLM2-shaped decode step on a 2-core CPU. The CUDA and NPU
    serve paths have not been run with it on their devices yet, so they keep the plain mode."""
    mode = torch.inference_mode() if executor.platform.device().type == "cpu" else nullcontext()
    with mode:
        hidden = executor.execute(inputs.input_ids, inputs.positions, inputs.metadata)
        scored = None
        if inputs.prompt_rows is not None:
            rows = inputs.prompt_rows.to(hidden.device, non_blocking=True)
            scored = executor.compute_logits(hidden, rows)
        if not inputs.sampled_request_ids:
            return None, scored
        # The sampled rows are strictly increasing, so as many as there are tokens means every
        # row in order (a decode batch): no selection, which on a GPU is two launches per step
        every_row = inputs.selected_idxes.shape[0] == inputs.input_ids.shape[0]
        rows = None if every_row else inputs.selected_idxes
        return executor.compute_logits(hidden, rows), scored
