"""A small generic name -> item registry whose errors list what is known."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T | None = None, *, replace: bool = False):
        """``register(name, item)`` or ``@register(name)``; the decorator returns what it wraps."""

        def add(it: T) -> T:
            if name in self._items and not replace:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = it
            return it

        return add(item) if item is not None else add

    def unregister(self, name: str) -> None:
        self._items.pop(name, None)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "none"
            raise KeyError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items


def lazy(target: str) -> Callable[[], object]:
    """A loader for ``"package.module:attr"`` that imports only when called."""

    def load() -> object:
        import importlib

        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)

    load.target = target  # type: ignore[attr-defined]
    return load
