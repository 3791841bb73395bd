"""Everything that touches SGLang, a folder per process and seam in the order `plugin.hooks()` meets them: `http`
(the HTTP server process), `scheduler` (the scheduler process: cache backend, hints, admission, the blend, reports),
`forward` (the blend's passes of SGLang's model and their attention), `decode` (the decode step), and `serve` (a
server's settings, start and stop). At the top: `plugin` (the entry point, the one module that imports the folders),
`lang` (frontend programs) and `kernel_guard`.

Kept import-light on purpose: `kernel_guard` is imported from a .pth file at every interpreter start-up. The folders'
`__init__` files import nothing either, so a module imported alone (the harness's `serve.server_process`, the GPU
kernel bench's `forward.paged_attention`, which runs without sglang) brings only what it needs.
"""
