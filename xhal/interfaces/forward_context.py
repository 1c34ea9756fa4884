"""The guarded per-step context: the one piece of ambient state in xhal.

The executor enters ``forward_context(...)`` around the model's forward; ``layers.Attention`` and
the tensor-parallel layers read it through ``get_forward_context()``. Entering while a context is
active is an error (no nesting), and reading it outside a step is a clear error.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xhal.interfaces.attention import AttentionBackend
    from xhal.interfaces.collective import Collective
    from xhal.interfaces.metadata import AttentionMetadata


@dataclass(frozen=True)
class ForwardContext:
    """What layers may reach during one step.

    ``attention[layer_id]`` is the backend serving that layer (already planned for this step);
    ``metadata`` is None outside attention work (e.g. while computing logits);
    ``collective`` is the tensor-parallel group's. (A host's layer synchronizer is the
    executor's business, not the layers': see ``xhal.executor.layer_sync``.)
    """

    metadata: AttentionMetadata | None
    attention: Mapping[int, AttentionBackend]
    collective: Collective


_current: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "xhal_forward_context", default=None
)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    if _current.get() is not None:
        raise RuntimeError("forward_context is already active: nested steps are not allowed")
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError(
            "no forward context: xhal layers run only inside ModelExecutor.execute "
            "(or a `with forward_context(...)` block)"
        )
    return ctx
