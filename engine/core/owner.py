"""One owner for the engine's state: the scheduler, the KV cache, the answers and the cost model's
correction are changed by the engine thread alone; the serving layer talks to it by messages
(engine/core/messages.py) and reads what it publishes.

With $FLOWPREFILL_CHECK_OWNER=1 (the test suite sets it) each changing method of those objects checks
that it runs on its owner's thread and raises `NotOwner` otherwise; without it the methods are
undecorated (no cost). An object has no owner until the engine thread claims it (`claim`): the
constructing thread builds and calibrates it, unit tests drive it alone.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

CHECK = os.environ.get("FLOWPREFILL_CHECK_OWNER") == "1"

F = TypeVar("F", bound=Callable[..., Any])


class NotOwner(RuntimeError):
    """Engine state was changed off the thread that owns it."""


class Owned:
    """Mixin of an object the engine thread owns (`_owner`: that thread, or None before it runs)."""

    _owner: threading.Thread | None = None

    def claim(self, thread: threading.Thread | None) -> None:
        """`thread` owns this object from now on (None: no thread yet, or the owner has ended)."""
        self._owner = thread


def owned(method: F) -> F:
    """Mark a method that changes an `Owned` object's state: checked under $FLOWPREFILL_CHECK_OWNER."""
    if not CHECK:
        return method

    @functools.wraps(method)
    def checked(self: Owned, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner
        if owner is not None and threading.current_thread() is not owner:
            raise NotOwner(f"{type(self).__name__}.{method.__name__} called on thread "
                           f"{threading.current_thread().name!r}; only {owner.name!r} may change it")
        return method(self, *args, **kwargs)

    return checked  # type: ignore[return-value]
