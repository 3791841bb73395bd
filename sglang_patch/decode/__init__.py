"""The decode step: the CPU attention backend `chunkcache_torch` (`decode_attention`), and SpeCache decoding
(`specache`, config `decode.specache`) with its low-bit side pool (`specache_pool`).

Imports `serve` (the server's config) and no other folder.
"""
