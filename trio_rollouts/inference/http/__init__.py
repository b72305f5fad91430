"""The HTTP layer of the inference backends: transports and the lean connection pool,
with no knowledge of what is posted (no OpenAI bodies, replies or errors beyond the
transport's own).

- :mod:`._transport`: the :class:`~._transport.Transport` protocol (POST a JSON body, get
  a whole :class:`~._transport.Response`), its two implementations (the lean pool and
  httpx2, for proxies), and the one map of transport failures to
  :class:`~trio_rollouts.inference.InferenceError`.
- :mod:`._pool`: :class:`~._pool.ConnectionPool`, the lean Trio-native HTTP/1.1 pool
  (slots, keep-alive, timeouts, fairness).
- :mod:`._connection`: origins, connections and request heads built once.
- :mod:`._wire`: the pool's errors and responses, and llhttp's reading of them.
- :mod:`._lookup`: shared name lookups and connecting to the first address that accepts.
"""
