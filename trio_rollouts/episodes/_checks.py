"""The checks of the settings that :class:`~trio_rollouts.MultiTurnAgent` and the
gateway share: the renderer, ``on_break``, ``min_fidelity``, and whether the renderer's
ids are the backend's.

The first three are attrs validators (``(instance, attribute, value)``; the gateway's
``serve`` calls them with ``None, None``); each raises an error that names the setting,
the value and what is allowed. :func:`check_vocabulary` runs when a stream opens or a
gateway starts, before any work.
"""

from __future__ import annotations

from typing import Any

import attrs

from trio_rollouts.episodes._errors import describe_backend
from trio_rollouts.inference._interface import CODE_POINTS, token_vocabulary
from trio_rollouts.models._rollouts import FIDELITY_LEVELS
from trio_rollouts.renderers import Renderer

__all__ = ["check_min_fidelity", "check_on_break", "check_renderer", "check_vocabulary"]


def check_renderer(instance: object, attribute: attrs.Attribute[Any] | None, value: Any) -> None:
    """``value`` must be a :class:`~trio_rollouts.Renderer` instance (a ``TypeError``
    that says to call a class given in its place)."""
    if isinstance(value, type):
        msg = (
            f"renderer must be a Renderer instance, got the class {value.__name__}: "
            f"call it ({value.__name__}(...))"
        )
        raise TypeError(msg)
    if not isinstance(value, Renderer):
        msg = (
            f"renderer must be a Renderer (PlainRenderer, HFRenderer or one of your own), "
            f"got {type(value).__name__} {value!r:.60}"
        )
        raise TypeError(msg)


def check_on_break(instance: object, attribute: attrs.Attribute[Any] | None, value: Any) -> None:
    """``value`` must be ``"split"`` or ``"raise"``."""
    if value not in ("split", "raise"):
        msg = f"on_break must be 'split' or 'raise', got {value!r:.40}"
        raise ValueError(msg)


def check_min_fidelity(
    instance: object, attribute: attrs.Attribute[Any] | None, value: Any
) -> None:
    """``value`` must be a fidelity level (``"exact"``, ``"server_tokens"``,
    ``"retokenized"``)."""
    if value not in FIDELITY_LEVELS:
        allowed = ", ".join(repr(level) for level in FIDELITY_LEVELS)
        msg = f"min_fidelity must be one of {allowed}, got {value!r:.40}"
        raise ValueError(msg)


def check_vocabulary(renderer: object, interface: object, who: str) -> None:
    """Refuse a renderer whose ids ``interface`` cannot take: the backend says what its
    token ids are (:func:`~trio_rollouts.inference.token_vocabulary`) and the
    renderer's ``token_vocabulary`` is not that. A ``TypeError`` naming ``who``, the
    renderer, the backend, both vocabularies and the fix. A backend that does not know
    its vocabulary (a server's model) is taken on trust."""
    theirs = token_vocabulary(interface)
    if theirs is None:
        return
    ours = getattr(renderer, "token_vocabulary", None)
    if ours == theirs:
        return
    msg = (
        f"{who}: the renderer {type(renderer).__name__} writes {_vocabulary(ours)}, but "
        f"{describe_backend(interface)} takes and returns {_vocabulary(theirs)}: it would "
        "read every prompt as other tokens, and its sampled ids would decode to garbage. "
        "Pair them by vocabulary: PlainRenderer() with EmbeddedInference (code points); "
        "HFRenderer(tokenizer) with a backend that serves that tokenizer's model "
        "(OpenAIInference against vLLM or SGLang, or offline "
        "trio_rollouts.testing.VocabularyInference(tokenizer))"
    )
    if ours is None and theirs == CODE_POINTS:
        msg += (
            f". If {type(renderer).__name__}'s ids are Unicode code points, say so: "
            f"token_vocabulary = {CODE_POINTS!r}"
        )
    raise TypeError(msg)


def _vocabulary(vocabulary: str | None) -> str:
    if vocabulary is None:
        return "ids of no declared vocabulary (its token_vocabulary is None)"
    if vocabulary == CODE_POINTS:
        return "Unicode code points as token ids"
    return f"the token ids of the vocabulary {vocabulary!r}"
