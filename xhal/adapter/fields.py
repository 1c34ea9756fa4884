"""The xLLM view's field names, and reading them from an object or a dict with type checks."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from numbers import Integral
from typing import Any

import torch

# int32 tensors on the compute device
DEVICE_TENSORS = (
    "slot_mapping",
    "block_table",
    "q_seq_lens",
    "kv_seq_lens",
    "q_cu_seq_lens",
    "kv_cu_seq_lens",
    "qo_indptr",
    "paged_kv_indptr",
    "paged_kv_indices",
    "paged_kv_last_page_len",
)
# int32 tensors on the CPU, same convention as their device twins; the paged-KV ones are what
# FlashInfer's host plan reads, carried through so the backend does not rebuild them
HOST_TENSORS = (
    "q_seq_lens_host",
    "kv_seq_lens_host",
    "paged_kv_indptr_host",
    "paged_kv_last_page_len_host",
)
SCALARS = (
    "kv_seq_lens_host_values",  # list[int], same convention as kv_seq_lens_host
    "is_prefill",
    "is_chunked_prefill",
    "batch_forward_type",
    "max_query_len",
    "max_seq_len",
)
FIELDS = DEVICE_TENSORS + HOST_TENSORS + SCALARS
_UNSET_AS_MINUS_ONE = ("batch_forward_type", "max_query_len", "max_seq_len")

# Attributes of xLLM's view the adapter does not consume; a dict dumped from a view may carry them.
IGNORED = frozenset(
    {
        "linear_state_indices",
        "has_initial_state",
        "dp_token_counts",
        "dp_is_decode",
        "expanded_decode_metadata",
    }
)


def read_view(view: Any) -> dict[str, Any]:
    """Every field of ``FIELDS`` from ``view`` (``None`` when absent).

    A dict is checked for unknown keys: a misspelt field fails loudly instead of reading as absent.
    """
    if isinstance(view, Mapping):
        unknown = sorted(k for k in view if k not in FIELDS and k not in IGNORED)
        if unknown:
            raise ValueError(
                f"unknown metadata field(s) {unknown}; known fields: {', '.join(FIELDS)}"
            )
        f = {name: view.get(name) for name in FIELDS}
    else:
        # xLLM's view exposes only some attributes (e.g. no q_seq_lens_host); absent reads as None
        f = {name: getattr(view, name, None) for name in FIELDS}
    for name in _UNSET_AS_MINUS_ONE:
        if f[name] == -1:  # xhal_metadata.h's "unset" for these int fields
            f[name] = None
    return f


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when one of them leaves the index open."""
    if a == b:  # the common case, and the cheap test
        return True
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_tensor(name: str, t: Any, device: torch.device, *, host: bool) -> torch.Tensor:
    """Check that field ``name`` is an int32 tensor on ``device`` (or on the CPU when ``host``)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(
            f"metadata field {name} must be a torch.Tensor or None, got {type(t).__name__}"
        )
    if t.dtype != torch.int32:
        raise ValueError(f"metadata field {name} has dtype {t.dtype}, expected torch.int32")
    want = torch.device("cpu") if host else device
    if not same_device(t.device, want):
        where = "a CPU (host) tensor" if host else f"on the compute device {device}"
        raise ValueError(f"metadata field {name} is on {t.device}, expected {where}")
    return t


def check_shape(
    name: str, t: torch.Tensor, allowed: tuple[tuple[int, ...], ...], why: str | Callable[[], str]
) -> None:
    """Raise naming ``name`` unless ``t.shape`` is one of ``allowed``; ``why`` explains the rule
    (a callable is only called to build the message: this check runs on every step)."""
    if tuple(t.shape) not in allowed:
        want = " or ".join(str(list(s)) for s in allowed)
        why = why() if callable(why) else why
        raise ValueError(
            f"metadata field {name} has shape {list(t.shape)}, expected {want} ({why})"
        )


def host_values(name: str, values: Any) -> torch.Tensor:
    """A ``list[int]`` field as an int32 CPU tensor."""
    if not isinstance(values, Sequence) or not all(isinstance(v, Integral) for v in values):
        raise ValueError(f"metadata field {name} must be a list of ints")
    return torch.tensor([int(v) for v in values], dtype=torch.int32)
