"""Reasoning in an opening block: ``<think>...</think>`` and the like."""

from __future__ import annotations


def split(
    text: str, start: str, end: str, *, opened: bool, strip: bool = True
) -> tuple[str | None, str]:
    """``(reasoning, rest)``: the block that opens the turn (or that the generation
    prompt opened, ``opened``), stripped of its tags; a block never closed (a cut turn)
    runs to the end. No block: ``(None, text)``. ``strip``: the newlines around the
    reasoning, and those opening the rest, are the template's (it writes its own)."""
    body = text
    if not opened:
        stripped = text.lstrip()
        if not stripped.startswith(start):
            return None, text
        body = stripped[len(start) :]
    reasoning, closed, rest = body.partition(end)
    if strip:
        reasoning, rest = reasoning.strip("\n"), rest.lstrip("\n")
    return reasoning, rest if closed else ""


def think(text: str, *, opened: bool) -> tuple[str | None, str]:
    """``deepseek_r1``, ``qwen3``, ``glm45``, ``kimi_k2``: ``<think>...</think>``."""
    return split(text, "<think>", "</think>", opened=opened)
