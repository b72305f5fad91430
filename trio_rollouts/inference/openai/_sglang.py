"""SGLang's per-token weight versions: exact ``policy_epoch`` boundaries on its OpenAI
routes, as vLLM's native route gives them.

SGLang stamps the weight version of each generated token (sglang#32660): ``weight_versions``
in a native ``/generate`` reply's ``meta_info``, and in the ``sglext`` object of a reply on
its OpenAI routes (per choice when the request asked ``n``). The version is the label last
set by ``POST /update_weight_version``, which :meth:`OpenAIInference.resume` sends with the
new epoch. Two shapes are read: spans, ``[{"version", "start", "end"}]`` over the generated
tokens (vLLM's form), and one label per generated token.

A label the interface set becomes its epoch; any other (``"default"`` before the first
update, or a label set by someone else) is not guessed into an epoch: the response keeps
the epoch its call started under. A replica counts as stamping once the interface has
labelled it and as long as its replies carry labels it set.
"""

from __future__ import annotations

import attrs

from trio_rollouts.inference.openai._vllm import Span, policy_boundaries

__all__ = ["SGLangVersions", "reply_spans"]


def _spans_of(value: object) -> list[Span] | None:
    """Spans from either shape (``None`` if ``value`` is neither)."""
    if not isinstance(value, list):
        return None
    if all(isinstance(item, str) for item in value):  # one label per token
        spans: list[Span] = []
        for position, label in enumerate(value):
            if spans and spans[-1].version == label:
                spans[-1] = Span(label, spans[-1].start, position + 1)
            else:
                spans.append(Span(label, position, position + 1))
        return spans
    spans = []
    for item in value:
        if not isinstance(item, dict):
            return None
        version, start, end = item.get("version"), item.get("start"), item.get("end")
        if not isinstance(version, str) or type(start) is not int or type(end) is not int:
            return None
        spans.append(Span(version, start, end))
    return spans


def reply_spans(data: object, n: int) -> list[list[Span] | None]:
    """The weight-version spans of each of the ``n`` choices of an SGLang reply (``None``
    for a choice it does not stamp): from a choice's ``meta_info`` or ``sglext``, else the
    reply's ``sglext`` / ``meta_info`` (a list per choice, or one list for a single
    choice)."""
    found: list[list[Span] | None] = [None] * n
    if not isinstance(data, dict):
        return found
    choices = data.get("choices")
    for index in range(n):
        choice = choices[index] if isinstance(choices, list) and index < len(choices) else None
        for holder in ("meta_info", "sglext"):
            part = choice.get(holder) if isinstance(choice, dict) else None
            if isinstance(part, dict) and (spans := _spans_of(part.get("weight_versions"))):
                found[index] = spans
                break
    for holder in ("sglext", "meta_info"):
        part = data.get(holder)
        value = part.get("weight_versions") if isinstance(part, dict) else None
        if not isinstance(value, list) or not value:
            continue
        per_choice = value if isinstance(value[0], list) else [value]
        for index, each in enumerate(per_choice[:n]):
            if found[index] is None:
                found[index] = _spans_of(each)
    return found


@attrs.define(eq=False)
class SGLangVersions:
    """What one interface knows of its SGLang replicas' weight versions (index =
    replica), kept for the interface's life."""

    #: The labels this interface set (``str(epoch)``), and their epochs.
    labels: dict[str, int]
    #: Replicas this interface labelled (a resume sent them a version).
    labelled: list[bool]
    #: Replicas that, once labelled, replied without versions or with one it did not set.
    unstamped: list[bool]

    @classmethod
    def for_replicas(cls, n: int) -> SGLangVersions:
        return cls(labels={}, labelled=[False] * n, unstamped=[False] * n)

    @property
    def stamps(self) -> bool:
        """Every replica labelled by this interface and stamping with its labels."""
        return all(self.labelled) and not any(self.unstamped)

    def labelled_all(self, epoch: int) -> None:
        """Every replica took ``str(epoch)`` as its version."""
        self.labels[str(epoch)] = epoch
        self.labelled = [True] * len(self.labelled)

    def boundaries(self, index: int, spans: list[Span] | None) -> list[tuple[int, int]]:
        """``policy_epoch`` boundaries from replica ``index``'s spans, or ``[]`` (the
        caller stamps the start epoch) when they are missing or carry a label this
        interface did not set."""
        if spans is None or any(span.version not in self.labels for span in spans):
            if self.labelled[index]:
                self.unstamped[index] = True
            return []
        boundaries, _ = policy_boundaries(spans, self.labels, 0)
        return boundaries
