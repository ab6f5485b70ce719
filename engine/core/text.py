"""Text that may be the start of a marker (a stop string, a reasoning or tool-call tag) is held back
until the next token says whether it is: shared by the engine's output stream (engine/core/decode.py) and
the serving layer's parsers (engine/serving/reasoning.py, engine/serving/tool_calls.py)."""

from __future__ import annotations


def prefix_overlap(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker: how much of text to hold
    back because the marker may be beginning there."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
