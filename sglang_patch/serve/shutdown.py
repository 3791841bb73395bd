"""SGLang's processes stopped without leaking named semaphores or breaking multiprocessing's resource tracker.

SGLang stops its processes with SIGKILL (`utils.kill_process_tree`): `Engine.shutdown()`, run by the caller and again
by the engine's atexit handler, kills every descendant of the calling process; a server's main process does the same
to its own tree on SIGTERM. Among those descendants is multiprocessing's resource tracker, the helper process that
unlinks the named semaphores (/dev/shm/sem.mp-...) its process and that process's spawned children registered, if
they do not. Two consequences, both fixed here:

* In a process running an in-process engine (the tests, chunkbench's SpeCache and shuffled-TTFT runs), a semaphore
  registered before the shutdown (tqdm's lock, made by the first progress bar) is unregistered at exit with a fresh
  tracker that never saw it: "resource_tracker: process died unexpectedly, relaunching. Some resources might leak."
  and a `KeyError: '/mp-...'` traceback. `shutdown_engine` runs `Engine.shutdown()` with the tracker spared, and
  drops the engine's atexit re-run, which would kill it at exit instead.
* tqdm's default lock is a multiprocessing RLock, a named semaphore, made by the first progress bar of a process: a
  scheduler's weight loading. A SIGKILLed process never unlinks it, and neither does its killed tracker: one file
  leaked in /dev/shm per engine or server start. `thread_lock_for_progress_bars`, which the plugin runs in every
  SGLang process before any bar, gives tqdm a thread lock instead (the lock orders the bars of one process; SGLang's
  processes do not share bars).
"""

from __future__ import annotations

import atexit
import os
import threading


def shutdown_engine(engine) -> None:
    """`engine.shutdown()` for an in-process `sgl.Engine`, sparing this process's resource tracker, and no second
    shutdown at exit."""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)  # None: this process never started one
    scope = engine.shutdown.__func__.__globals__  # the module Engine.shutdown runs in, and its kill_process_tree
    kill = scope["kill_process_tree"]

    def sparing_the_tracker(parent_pid, *args, **kwargs):
        if parent_pid in (None, os.getpid()) and len(args) < 2 and kwargs.get("skip_pid") is None:
            kwargs["skip_pid"] = tracker
        return kill(parent_pid, *args, **kwargs)

    scope["kill_process_tree"] = sparing_the_tracker
    try:
        engine.shutdown()
    finally:
        scope["kill_process_tree"] = kill
    atexit.unregister(engine.shutdown)


def thread_lock_for_progress_bars() -> None:
    """tqdm's bars in this process ordered by a thread lock, not a named semaphore (see the module docstring)."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
