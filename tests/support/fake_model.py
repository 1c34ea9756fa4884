"""The fake model the scheduler tests run: the next token is a function of the whole context,
so any token read from the wrong place (a stale KV slot, a misplaced placeholder) changes it."""

from __future__ import annotations


def next_token(context: list[int]) -> int:
    return (sum(context) * 31 + len(context)) % 1000


def reference(prompt: list[int], n: int) -> list[int]:
    """``prompt`` followed by the fake model's ``n`` greedy tokens."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq


def reference_output(prompt: list[int], n: int) -> list[int]:
    """The fake model's ``n`` tokens after ``prompt``."""
    return reference(prompt, n)[len(prompt) :]
