"""The objects whose methods are running now, read from the Python stacks: how an adapter finds the framework
object driving a backward pass. Every thread's stack is read: CUDA runs autograd hooks on a device thread."""

from __future__ import annotations

import sys


def running_owners(names: tuple[str, ...]) -> list:
    """The ``self`` of each running frame whose function is named in ``names``, innermost first: this
    thread's (from the caller up), then every thread's."""
    owners = []
    frames = [sys._getframe(1)] + list(sys._current_frames().values())
    try:
        for frame in frames:
            while frame is not None:
                if frame.f_code.co_name in names:
                    owners.append(frame.f_locals.get("self"))
                frame = frame.f_back
    finally:
        del frames, frame  # frames held here would keep every frame's locals (the optimizer) alive: a cycle
    return owners
