"""What a replica serves: ``GET {base_url}/models``, asked when a request fails with a 404
about its model, so that the error can name the models the server does serve.

Asked at most once per replica and Trio run (:class:`ServedModels` lives in the run's
state): a wrong ``model`` fails every request at once, and hundreds of concurrent 404s
share one ``GET``. Nothing here may make the original error worse: a ``/models`` that
fails, times out, or answers something else than OpenAI's list, gives ``None``, and the
caller keeps the server's own message.
"""

from __future__ import annotations

from typing import Final

import attrs
import trio

from trio_rollouts.inference._errors import InferenceError
from trio_rollouts.inference.http._transport import Transport

__all__ = ["ServedModels", "model_not_served"]

#: How long the ``GET /models`` of an error path may take; the error waits for it.
MODELS_TIMEOUT: Final = 10.0
#: Model names shown in an error; more are counted.
_SHOWN_MODELS: Final = 20


@attrs.define(eq=False)
class _Asked:
    done: trio.Event = attrs.field(factory=trio.Event)
    names: tuple[str, ...] | None = None


@attrs.define(eq=False)
class ServedModels:
    """The models each replica served when asked, per Trio run (index = replica)."""

    _asked: dict[int, _Asked] = attrs.field(factory=dict)

    async def names(
        self, transport: Transport, replica: int, url: str, shown: str
    ) -> tuple[str, ...] | None:
        """The ids in ``GET url`` (``{base_url}/models``), asked once for ``replica``;
        ``None`` when that failed. Concurrent callers share the one request.

        Cancellation: cancellable; if the task asking is cancelled, the next caller asks.
        """
        while (asked := self._asked.get(replica)) is not None:
            if asked.done.is_set():
                return asked.names
            await asked.done.wait()
        asked = self._asked[replica] = _Asked()
        try:
            with trio.move_on_after(MODELS_TIMEOUT):
                asked.names = await _model_ids(transport, url, shown)
        except BaseException:
            del self._asked[replica]  # cancelled: the next caller asks again
            raise
        finally:
            asked.done.set()
        return asked.names


async def _model_ids(transport: Transport, url: str, shown: str) -> tuple[str, ...] | None:
    try:
        response = await transport.get(url, shown)
    except InferenceError:
        return None
    if response.status_code != 200:
        return None
    try:
        data = response.json()
    except ValueError:
        return None
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return None
    ids = [entry.get("id") for entry in entries if isinstance(entry, dict)]
    return tuple(name for name in ids if isinstance(name, str))


def model_not_served(model: str, root: str, served: tuple[str, ...]) -> str | None:
    """``model 'x' is not served by <root>; it serves: 'a', 'b'``, or ``None`` when
    ``model`` is among ``served`` (the 404 is about something else)."""
    if model in served:
        return None
    if not served:
        return f"model {model!r} is not served by {root}; it lists no models at {root}/models"
    names = ", ".join(repr(name) for name in served[:_SHOWN_MODELS])
    more = len(served) - _SHOWN_MODELS
    if more > 0:
        names += f" and {more} more (GET {root}/models)"
    return f"model {model!r} is not served by {root}; it serves: {names}"
