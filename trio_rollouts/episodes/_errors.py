"""The errors of token-exact episodes, and the words that explain them.

:class:`TemplateBreakError` (a conversation that cannot go on as one token stream, with
``on_break="raise"``) and :class:`TokenFidelityError` (ids less faithful than
``min_fidelity`` allows) are raised by :class:`~trio_rollouts.MultiTurnAgent` and by the
gateway's sessions alike; neither is transient. This module also words the messages the
two share with :class:`~trio_rollouts.inference.TokenMismatchError` (a token-in backend
that generated from other ids): which backend, what it lacked, and the fix.
"""

from __future__ import annotations

from trio_rollouts.inference._errors import TokenMismatchError

__all__ = [
    "TemplateBreakError",
    "TokenFidelityError",
    "describe_backend",
    "fidelity_error",
    "token_mismatch",
    "what_lacked",
]


class TemplateBreakError(RuntimeError):
    """An episode could not be continued as one token stream (the renderer could not
    prove a bridge, the tool set changed, or the server rendered another prompt than the
    episode's ids) and the agent's ``on_break`` is ``"raise"``. Not transient: the same
    conversation breaks the same way again."""


class TokenFidelityError(RuntimeError):
    """A turn's ids would be less faithful than the agent's ``min_fidelity`` allows: the
    message names the backend, what it lacked, and the fix. Not transient."""


def describe_backend(interface: object) -> str:
    """The backend as an error names it: its class, and its replicas' URLs when it has
    them (``OpenAIInference``)."""
    urls = getattr(interface, "base_url", None)
    name = type(interface).__name__
    if isinstance(urls, tuple) and urls:
        return f"{name} ({', '.join(map(str, urls))})"
    return name


def fidelity_error(interface: object, fidelity: str, minimum: str, lacked: str) -> str:
    """The message of a :class:`TokenFidelityError`: ``interface`` ``lacked`` something,
    so a turn's ids would be ``fidelity``, below ``minimum``; and the ways out."""
    return (
        f"{describe_backend(interface)} {lacked}, so the turn's ids would be {fidelity!r}, below "
        f"min_fidelity={minimum!r}. Use a backend that generates from token ids "
        "(AcceptsTokens: OpenAIInference against vLLM or SGLang, EmbeddedInference) or "
        "one that returns the ids it rendered and sampled (ReturnsTokens), or lower "
        f"min_fidelity to {fidelity!r} to train on these ids knowingly"
    )


def what_lacked(fidelity: str) -> str:
    """What a backend whose markers promise ``fidelity`` lacks, for
    :func:`fidelity_error`."""
    if fidelity == "server_tokens":
        return "renders the chat itself (it does not generate from token ids)"
    return "returns text only (no token ids)"


def token_mismatch(interface: object, sent: list[int], echoed: list[int]) -> TokenMismatchError:
    """The error of a token-in turn whose backend echoed other prompt ids than it was
    sent: where they first differ, and both lengths."""
    index = next(
        (i for i, (a, b) in enumerate(zip(sent, echoed, strict=False)) if a != b),
        min(len(sent), len(echoed)),
    )
    msg = (
        f"{describe_backend(interface)} generated from other ids than the episode's: they differ "
        f"first at index {index} (sent {len(sent)} ids, it echoed {len(echoed)})"
    )
    return TokenMismatchError(msg, sent=sent, echoed=echoed, index=index)
