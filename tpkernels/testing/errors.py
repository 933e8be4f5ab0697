"""Collect the error messages of calls that are expected to fail (multi-rank tests return them so the
parent can check that every rank raised the same documented error)."""

from __future__ import annotations

from typing import Callable, Iterable


def error_messages(calls: Iterable[Callable[[], object]], exc: type[BaseException] = ValueError) -> list[str | None]:
    """``str(e)`` of the ``exc`` each call raised, or None for a call that returned."""
    msgs: list[str | None] = []
    for call in calls:
        try:
            call()
            msgs.append(None)
        except exc as e:
            msgs.append(str(e))
    return msgs
