"""The blend of cached chunk KV with a few recomputed tokens, shared by every engine.

  plan       one request's chunks, where they sit and what is already exact (pure; `plan.plan_request`)
  pipeline   the steps of a batch's blend, in order: lookup, fill, learn, copy, features, select, recompute
  features   what selectors may ask of a request (memoised; the model passes come from the engine)
  attention  position-causal attention over a request's KV, used by every pass of both engines
  reuse      what a serving engine's blends share (config, store, selectors, models) and a request's hint resolved
             against it (`reuse.ChunkReuse`, `reuse.RequestHint.plan`)

Engines: chunkcache.reference (HF modules, one request) and sglang_patch.scheduler.blend.BatchEngine (SGLang's model
runner, one extend batch).
"""
