"""Graph capture and replay, as mechanics only."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from typing import Any


class GraphRunner(ABC):
    """Captures a function once per key and replays it.

    Invariants:

    - ``capture(key, fn)`` runs ``fn`` once under capture and returns its outputs; those output
      tensors are static: every ``replay(key)`` overwrites them in place and returns them again.
    - Replay re-runs exactly the device work recorded at capture on the same tensors: values
      written in place into the inputs ``fn`` read are seen, while Python-side values (ints,
      lists, branches taken) are baked at capture. A caller that needs new host values must
      capture a new key or update them through the backend's replay hook.
    - Work run under capture must not sync with the host or allocate by tensor values. Whether
      capture also executes the work is the runner's choice (a CUDA graph does not; the CPU
      reference's recorder does): callers read results only after a replay. A runner need not
      detect host syncs itself (the device's capture usually refuses them); the suite's graph
      family and the executor never issue them.
    - All captures of one runner share one memory pool. ``reset()`` drops every graph.
    - Piecewise capture: inside ``capture``, ``split(fn)`` ends the current piece, runs ``fn``
      eagerly, and starts the next piece. At every replay ``fn`` runs again, eagerly, between the
      replayed pieces (so it sees the host state of that moment, e.g. this step's attention plan),
      and its tensor result is copied into the tensor it returned at capture, which later pieces
      read. Outside a capture, ``split(fn)`` is just ``fn()``.
    - The runner owns no inputs, buckets or padding: the executor does.
    """

    @abstractmethod
    def capture(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        """Capture ``fn`` under ``key``; returns its (static) outputs."""

    @abstractmethod
    def replay(self, key: Hashable) -> Any:
        """Replay the graph of ``key``; returns the static outputs of its capture."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has been captured."""

    @abstractmethod
    def split(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` eagerly between two captured pieces (see the class docstring)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every captured graph and free the pool."""
