"""A request's chunk reuse, shared by every engine.

  request    one request's record from arrival to its last round (`ChunkRequest`), its hint, the stage names
  pipeline   the request's path in order: detect, plan, lookup, fill, learn, copy, features, select, recompute,
             record (one file; `pipeline.run` is one batch's blend)
  plan       one request's chunks, where they sit and what is already exact (pure; `plan.plan_request`)
  features   what selectors may ask of a request (memoised; the model passes come from the engine)
  attention  position-causal attention over a request's KV, used by every pass of both engines
  reuse      what a serving engine's blends share (config, store, selectors, models) and a payload resolved into a
             hint against it (`reuse.ChunkReuse.hint`)

Engines: chunkcache.reference (HF modules, one request) and sglang_patch.scheduler.blend.BatchEngine (SGLang's model
runner, one extend batch).
"""
