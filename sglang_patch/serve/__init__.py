"""A server's start and stop: the `chunkcache` console script (`cli`), the SGLang settings and config every process
of a server reads (`launcher`), one server subprocess's life (`server_process`), and SGLang's processes stopped
without leaking named semaphores (`shutdown`).

Imports no other folder: every other folder may read the server's settings from here.
"""
