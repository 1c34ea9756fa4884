"""Tensor-parallel linear layers (vLLM's vocabulary).

Every layer keeps only this rank's shard of its weight; ``weight_loader(param, loaded_weight[,
shard_id])`` takes the FULL checkpoint tensor and copies the shard. Collectives at forward time go
through the step's ``Collective`` (``get_forward_context().collective``) and are skipped at size 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from xhal import ops
from xhal.interfaces.forward_context import get_forward_context
from xhal.layers.parallel import TensorParallel
from xhal.layers.weights import check_shape, copy_shard

if TYPE_CHECKING:
    from xhal.layers.norm import RMSNorm


def _parameter(*shape: int) -> nn.Parameter:
    # uninitialized: every parameter is filled by load_weights, which reports any it did not fill
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W split by output rows: rank r holds rows ``[r*n, (r+1)*n)``.

    The output is this rank's slice of the features unless ``gather_output`` is set.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        tp: TensorParallel = TensorParallel(),
        *,
        output_size_per_partition: int | None = None,  # for uneven shards (replicated KV heads)
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = output_size_per_partition or tp.divide(
            output_size, "output_size"
        )
        self.gather_output = gather_output
        self.weight = _parameter(self.output_size_per_partition, input_size)
        self.bias = _parameter(self.output_size_per_partition) if bias else None

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        check_shape(loaded_weight, (self.output_size, *param.shape[1:]), type(self).__name__)
        n = self.output_size_per_partition
        copy_shard(param, loaded_weight, 0, self.tp.rank * n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear(x, self.weight, self.bias)  # [T, out / tp]
        if self.gather_output and self.tp.size > 1:
            y = get_forward_context().collective.all_gather(y, dim=-1)  # [T, out]
        return y

    def forward_normed(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(x, residual)[0]), x + residual)`` as one fused op: the residual add and
        RMSNorm that precede this projection (the norm is replicated on every rank)."""
        y, residual = ops.add_rms_norm_linear(
            x, residual, norm.weight, norm.eps, self.weight, self.bias
        )
        if self.gather_output and self.tp.size > 1:
            y = get_forward_context().collective.all_gather(y, dim=-1)  # [T, out]
        return y, residual


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate_up_proj).

    Each rank's weight is ``[shard of output 0 | shard of output 1 | ...]``; ``shard_id`` is the
    index of the checkpoint tensor being loaded (``None``: an already merged tensor).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        gather_output: bool = False,
        tp: TensorParallel = TensorParallel(),
    ) -> None:
        for i, size in enumerate(output_sizes):
            tp.divide(size, f"output_sizes[{i}]")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, gather_output, tp)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None:  # a merged checkpoint tensor: load it as its parts
            check_shape(loaded_weight, (self.output_size, *param.shape[1:]), type(self).__name__)
            for i, part in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        full = self.output_sizes[shard_id]
        check_shape(loaded_weight, (full, *param.shape[1:]), f"{type(self).__name__}[{shard_id}]")
        n = full // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        copy_shard(param, loaded_weight, 0, self.tp.rank * n, n, dst_start=offset)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W split by input columns; the partial products are summed over
    ranks (``reduce_results``) and the bias, kept whole on every rank, is added once after."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        tp: TensorParallel = TensorParallel(),
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = tp.divide(input_size, "input_size")
        self.input_is_parallel, self.reduce_results = input_is_parallel, reduce_results
        self.weight = _parameter(output_size, self.input_size_per_partition)
        self.bias = _parameter(output_size) if bias else None

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if param is self.bias:
            check_shape(loaded_weight, (self.output_size,), f"{type(self).__name__} bias")
            param.data.copy_(loaded_weight)
            return
        check_shape(loaded_weight, (self.output_size, self.input_size), type(self).__name__)
        n = self.input_size_per_partition
        copy_shard(param, loaded_weight, 1, self.tp.rank * n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return ops.linear(x, self.weight, self.bias)
        n = self.input_size_per_partition
        if not self.input_is_parallel:
            x = x.narrow(-1, self.tp.rank * n, n)  # [T, in / tp]
        return self.reduce_partial(ops.linear(x, self.weight))  # [T, out]

    def reduce_partial(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial product ``y`` ``[T, out]`` (no bias) summed over the ranks
        (``reduce_results``), then the bias added once."""
        if self.reduce_results:
            y = get_forward_context().collective.all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def _check_gated_input(self, method: str) -> None:
        if not self.input_is_parallel:
            raise ValueError(
                f"{method} takes this rank's gate | up shard; build the layer with "
                "input_is_parallel=True"
            )

    def forward_gated_block(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm: RMSNorm,
        gate_up: MergedColumnParallelLinear,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self.forward_silu_and_mul(gate_up.forward_normed(x, residual, norm)[0]), x +
        residual)`` as one op (``add_rms_norm_gated_mlp``): a gated MLP block with the residual
        add and norm ahead of it. ``gate_up`` holds this rank's gate | up rows, this layer the
        matching input columns; the bias joins after the sum over ranks."""
        self._check_gated_input("forward_gated_block")
        whole = self.tp.size == 1
        y, residual = ops.add_rms_norm_gated_mlp(
            x, residual, norm.weight, norm.eps, gate_up.weight, self.weight, gate_up.bias,
            self.bias if whole else None,
        )  # fmt: skip
        return (y if whole else self.reduce_partial(y)), residual

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``self(silu_and_mul(x))`` with the gated activation fused into this projection's
        input: x ``[T, 2 I / tp]`` is this rank's gate | up halves (always parallel)."""
        self._check_gated_input("forward_silu_and_mul")
        if self.tp.size == 1:
            return ops.silu_and_mul_linear(x, self.weight, self.bias)
        return self.reduce_partial(ops.silu_and_mul_linear(x, self.weight))


class ReplicatedLinear(nn.Module):
    """``y = x W^T (+ b)`` with the whole weight on every rank: small projections every rank
    needs in full, such as a mixture of experts' router."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = _parameter(output_size, input_size)
        self.bias = _parameter(output_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)  # [T, out]
