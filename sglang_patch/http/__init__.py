"""The HTTP server process (SGLang's main process): documents on /v1/chat/completions (`chat`), POST
/chunkcache/ingest (`ingest`), POST /chunkcache/purge (`admin`), both added to SGLang's app (`routes`), their prompts built off the event loop
(`prompt_worker`), chunk hints checked where the TokenizerManager tokenizes a request (`hint_validation`), and the
chunk report in OpenAI answers' usage (`usage`).

Imports `scheduler` (the radix partition reserved for hinted requests; the purge's control request) and `serve` (the
server's limits).
"""
