"""The scheduler process: the `chunkcache` radix-cache backend (`cache`), a request's hint resolved once per `Req`
(`request_hint`) or found by automatic detection (`auto_chunks`), chunk-aware admission (`admission`), the blended
prefill of an extend batch (`blend`), its per-request report (`report`) and /metrics (`metrics`).

Imports `forward` (the model passes the blend runs) and `serve` (the server's config).
"""
