"""OpenTelemetry spans per group: ``trio_rollouts.otel`` (the ``otel`` extra).

Turn it on once, before the streams you want traced open::

    from trio_rollouts import otel

    otel.instrument()  # the global TracerProvider, or instrument(tracer_provider=...)

Each ``group_rollout`` call of a pipeline opened afterwards is one span, ``rl.sample``,
with the events of its group's life: ``admitted``, ``first_token`` (the embedded
backend) or ``first_response`` (the first inference call that returned), ``done``,
``reward`` (``rl.reward_mean``) and ``delivered``; and the attributes ``rl.batch_id``,
``rl.index``, ``rl.start_epoch``, ``rl.staleness`` and ``rl.cuts`` when delivered, and
``rl.outcome`` (``delivered``, ``filtered``, ``stale``, ``failed``, ``cancelled``,
``not_taken``). Export them as any OpenTelemetry spans (OTLP to Jaeger, Tempo, ...).

Off (the default, or after :func:`uninstrument`), and without the extra installed, the
pipeline does no tracing work at all: it never imports OpenTelemetry.
"""

from __future__ import annotations

from typing import Any

from trio_rollouts.pipeline._tracing import state

__all__ = ["instrument", "is_instrumented", "uninstrument"]


def instrument(tracer_provider: Any | None = None) -> None:
    """Trace the pipelines opened from now on, with a tracer from ``tracer_provider``
    (default: OpenTelemetry's global provider).

    Raises ``ImportError`` naming the extra when ``opentelemetry-api`` is not installed
    (``pip install 'trio-rollouts[otel]'``).
    """
    try:
        from opentelemetry import trace
    except ImportError as exc:
        msg = (
            "trio_rollouts.otel needs OpenTelemetry: pip install 'trio-rollouts[otel]' "
            "(opentelemetry-api, and an SDK to export the spans)"
        )
        raise ImportError(msg) from exc
    state.tracer = trace.get_tracer("trio_rollouts", tracer_provider=tracer_provider)


def uninstrument() -> None:
    """Stop tracing pipelines opened from now on (those open keep their spans)."""
    state.tracer = None


def is_instrumented() -> bool:
    """Whether pipelines opened now are traced."""
    return state.tracer is not None
