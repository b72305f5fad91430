"""The JSON body of a request of :class:`~trio_rollouts.inference.OpenAIInference`: a
chat or completions request for a prompt of messages (:func:`request_body`), a
completions request for a prompt of token ids (:func:`token_request_body`), and the body
of one choice of a group sent on its own (:func:`choice_body`).

Bodies are built from the configuration and the request only; what a replica refused is
left out later, when the transport is about to write the body
(:meth:`~._negotiation.Capabilities.without_dropped`).
"""

from __future__ import annotations

from typing import Any

from trio_rollouts._messages import ChatMessage
from trio_rollouts.inference._interface import InferenceRequest
from trio_rollouts.inference._sampling import choice_seed
from trio_rollouts.inference.openai._config import OpenAIConfig

__all__ = ["choice_body", "message_json", "request_body", "token_request_body"]


def request_body(config: OpenAIConfig, request: InferenceRequest) -> dict[str, Any]:
    """A chat body (the messages, and tools) or a completions body (the prompt rendered
    by ``render_prompt``; tools are a ``ValueError``), asking what the options ask."""
    flags: dict[str, Any] = {}
    required: dict[str, Any] = {"model": config.model}
    if config.endpoint == "chat":
        if config.return_logprobs is not False:
            # top_logprobs too: llama-cpp-python's server answers null logprobs without
            # it; 1, not 0, as its completions path treats 0 as "no logprobs". It goes
            # with logprobs: dropped for a replica that refuses logprobs.
            flags["logprobs"] = True
            flags["top_logprobs"] = 1
        required["messages"] = [message_json(message) for message in request.prompt]
        if request.tools:
            required["tools"] = request.tools
    else:
        if request.tools:
            msg = (
                f"{type(config).__name__} with endpoint='completions' cannot send tools; "
                "use endpoint='chat'"
            )
            raise ValueError(msg)
        if config.return_logprobs is not False:
            # 1, not 0: some servers treat 0 as "no logprobs".
            flags["logprobs"] = 1
        required["prompt"] = config.render_prompt(request.prompt)
    if config.return_token_ids is not False:
        flags["return_token_ids"] = True
    return {
        **flags,
        **config.extra_body,
        **required,
        **request.generation_args.set_fields(),
    }


def token_request_body(config: OpenAIConfig, request: InferenceRequest) -> dict[str, Any]:
    """A ``/v1/completions`` body whose prompt is ``request.prompt_ids``, exactly: no
    chat template, no tools (they are in the ids). Token ids are always asked for:
    the response must carry the generated ids."""
    flags: dict[str, Any] = {"return_token_ids": True}
    if config.return_logprobs is not False:
        flags["logprobs"] = 1
    return {
        **flags,
        **config.extra_body,
        "model": config.model,
        "prompt": list(request.prompt_ids or []),
        **request.generation_args.set_fields(),
    }


def message_json(message: ChatMessage) -> dict[str, Any]:
    # Extra keys (tool_calls, tool_call_id, name) pass through; role and content win.
    return {**message.extra, "role": message.role, "content": message.content}


def choice_body(body: dict[str, Any], choice: int) -> dict[str, Any]:
    """The body of a group's choice ``choice`` sent on its own: ``body`` with the
    choice's seed (:func:`~._sampling.choice_seed`) when it has one."""
    seed = body.get("seed")
    if choice == 0 or not isinstance(seed, int) or isinstance(seed, bool):
        return body
    return {**body, "seed": choice_seed(seed, choice)}
