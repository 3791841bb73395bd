"""SpeCache (seed 003): decoding with a low-bit KV copy on the device, the full-precision KV on the host, and
the top-k full-precision pairs per KV head prefetched each step as chosen by a speculative second token. Not
SpecCache, whose selector (`spec`) is chunkcache.select.draft_norm.

One module per concept: `quant` (K per channel / V per token group quantiser), `layer_cache` (one layer's low-bit +
residual + prefetched view and its byte accounting), `step` (the two-token attention and the top-k choice),
`decode` (the reference decode loop over an HF model). Engine-agnostic: nothing here imports sglang.
"""
