"""xLLM's two layouts of the length fields, and turning host lengths into per-sequence values.

xLLM's ``BatchInputBuilder`` fills the length fields per platform (ARCHITECTURE.md section 2):

| field                       | ``"npu"``                        | ``"cuda"``                      |
|-----------------------------|----------------------------------|---------------------------------|
| q_seq_lens, kv_seq_lens     | per sequence, [B]                | cumulative, leading 0, [B+1]    |
| *_host, host values         | as the device twin               | as the device twin              |
| q_cu_seq_lens               | inclusive cumsum: [B] without    | sequence ends, [B] ([B+1] with  |
|                             | leading 0 (graph mode), or [B+1] | a leading 0 is also accepted)   |
| kv_cu_seq_lens, qo_indptr   | cumulative, leading 0, [B+1]     | cumulative, leading 0, [B+1]    |
"""

from __future__ import annotations

from typing import Literal

import torch

Convention = Literal["npu", "cuda"]
CONVENTIONS: tuple[str, ...] = ("npu", "cuda")


def parse_convention(convention: str) -> Convention:
    """Return ``convention`` if known, else raise ``ValueError`` listing the known ones."""
    if convention not in CONVENTIONS:
        raise ValueError(
            f"unknown convention {convention!r}; expected one of {list(CONVENTIONS)} "
            "(pick the convention of the platform whose xLLM build filled the metadata)"
        )
    return convention  # type: ignore[return-value]


def is_cumulative(convention: Convention) -> bool:
    """Whether ``q_seq_lens``/``kv_seq_lens`` (and their host twins) hold cumulative lengths."""
    return convention == "cuda"


def seq_lens_numel(convention: Convention, num_seqs: int) -> int:
    """Length of ``q_seq_lens``/``kv_seq_lens`` for ``num_seqs`` sequences in ``convention``."""
    return num_seqs + 1 if is_cumulative(convention) else num_seqs


def describe(convention: Convention, num_seqs: int) -> str:
    """The rule for the length fields, for error messages."""
    form = "cumulative with leading 0, [B+1]" if is_cumulative(convention) else "per sequence, [B]"
    return f"convention {convention!r}: {form}; B={num_seqs} rows of block_table"


def per_seq_host(
    name: str, host: torch.Tensor, convention: Convention, *, check: bool
) -> torch.Tensor:
    """Per-sequence lengths ``[B]`` from host lengths in ``convention``.

    Per-sequence input is returned as is (a view); cumulative input is differenced on the host.
    """
    if not is_cumulative(convention):
        if check and host.numel() and int(host.min()) < 0:
            raise ValueError(f"metadata field {name} has a negative length: {host.tolist()}")
        return host
    if check:
        if int(host[0]) != 0:
            raise ValueError(
                f"metadata field {name} must start with 0 in convention 'cuda' (cumulative "
                f"lengths with a leading 0), got {host.tolist()}"
            )
        if bool((host[1:] < host[:-1]).any()):
            raise ValueError(
                f"metadata field {name} must be non-decreasing (cumulative), got {host.tolist()}"
            )
    return torch.diff(host)


def cumulative(per_seq: torch.Tensor) -> torch.Tensor:
    """``[0, l0, l0+l1, ...]`` as int32 ``[B+1]``."""
    return torch.cat([torch.zeros(1, dtype=torch.int32), per_seq.cumsum(0, dtype=torch.int32)])
