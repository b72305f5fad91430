"""The OpenAI-compatible HTTP backend, :class:`~._client.OpenAIInference` (exported by
``trio_rollouts.inference``), split by what each part knows.

- :mod:`._client`: the client, one request's life (placement, retries, pauses, groups,
  continuations); :mod:`._lifetime` its life besides requests (per-run state and the
  ``async with``, statistics, probe, pause and resume); :mod:`._config` its configuration.
- :mod:`._dialect`: the :class:`~._dialect.Dialect` protocol (route, pause, resume,
  stamp, continue) and the plain OpenAI API; :mod:`._vllm` (with :mod:`._vllm_wire` and
  :mod:`._vllm_state`) and :mod:`._sglang` the servers' dialects; :mod:`._versions`
  weight versions as epoch boundaries; :mod:`._control` the control-endpoint fan-out and
  the client-side hold.
- :mod:`._learned`: what the interface learns about its replicas, in one object;
  :mod:`._run`: what one Trio run holds; :mod:`._statistics`: the counts.
- :mod:`._attempt`: one attempt on one replica; :mod:`._bodies` request bodies;
  :mod:`._parse` replies; :mod:`._negotiation` and :mod:`._refusals` what a refusal
  means; :mod:`._continuation` continuing an aborted call; :mod:`._probe` the probe.
"""
