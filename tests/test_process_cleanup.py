"""SGLang's shutdown leaves multiprocessing's resource tracker working and no named semaphore behind
(sglang_patch.serve.shutdown). The oracle is a fresh interpreter's stderr at exit, where the tracker's complaints are
printed: "process died unexpectedly, relaunching", a `KeyError: '/mp-...'` traceback, "leaked semaphore objects"."""

import subprocess
import sys
import multiprocessing
import textwrap
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry
from tqdm import std

from sglang_patch import plugin

ROOT = Path(__file__).resolve().parents[1]

# A stand-in engine whose shutdown is SGLang's as far as the tracker is concerned (Engine.shutdown ends with
# kill_process_tree(os.getpid(), include_parent=False): every descendant SIGKILLed and waited for), with a spawned
# stand-in for its scheduler, and its atexit re-run; the real engine's run is the slow test below.
ENGINE = textwrap.dedent("""
    import atexit, multiprocessing as mp, os, sys, time
    import psutil
    from sglang_patch.serve.shutdown import shutdown_engine

    def kill_process_tree(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
        killed = [p for p in psutil.Process(parent_pid or os.getpid()).children(recursive=True) if p.pid != skip_pid]
        for p in killed:
            p.kill()
        psutil.wait_procs(killed, timeout=wait_timeout)  # SGLang's waits until they are gone, as here

    class Engine:
        def __init__(self):
            atexit.register(self.shutdown)

        def shutdown(self):
            kill_process_tree(os.getpid(), include_parent=False, wait_timeout=60)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        lock = ctx.Lock()  # a named semaphore of this process, registered with its tracker (tqdm's lock is one)
        scheduler = ctx.Process(target=time.sleep, args=(600,), daemon=True)  # shares this process's tracker
        scheduler.start()
        engine = Engine()
        shutdown_engine(engine) if sys.argv[1] == "shutdown_engine" else engine.shutdown()
        print("scheduler killed", not psutil.pid_exists(scheduler.pid))  # and reaped by the kill's wait
""")


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_engine_shutdown_spares_the_resource_tracker():
    bare = run("-c", ENGINE, "bare")  # the control: the blanket kill alone breaks the tracker
    assert "scheduler killed True" in bare.stdout, bare.stderr[-3000:]
    assert "process died unexpectedly" in bare.stderr and "KeyError: '/mp-" in bare.stderr, bare.stderr[-3000:]
    spared = run("-c", ENGINE, "shutdown_engine")
    assert spared.returncode == 0 and "scheduler killed True" in spared.stdout, spared.stderr[-3000:]
    assert "resource_tracker" not in spared.stderr and "Traceback" not in spared.stderr, spared.stderr[-3000:]


def test_progress_bars_in_sglang_processes_make_no_named_semaphore(monkeypatch):
    """plugin.register runs in every SGLang process before a scheduler loads its weights (with progress bars)."""
    monkeypatch.delattr(std.tqdm, "_lock", raising=False)  # as in a fresh process: no bar made yet
    monkeypatch.delattr(std.TqdmDefaultWriteLock, "mp_lock", raising=False)
    # SGLang's processes use the spawn start method, under which a multiprocessing lock is a named semaphore (fork's
    # are unlinked at once and never registered)
    monkeypatch.setattr(multiprocessing.context._default_context, "_actual_context",
                        multiprocessing.get_context("spawn"))
    registered = []
    register = resource_tracker.register
    monkeypatch.setattr(resource_tracker, "register", lambda name, rtype: (registered.append(name),
                                                                         register(name, rtype)))
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, *args, **kwargs: None))
    plugin.register()
    from tqdm.auto import tqdm  # what SGLang's weight loading uses

    for _ in tqdm(range(3)):
        pass
    assert registered == []


@pytest.mark.slow
def test_two_engines_in_one_process_end_without_a_tracker_complaint(tmp_path):
    """Two in-process engines of a tiny model, one after the other, and a bar of the caller's own in between (a
    semaphore registered with the resource tracker, which SGLang's shutdown would kill: sglang_patch/serve/shutdown.py),
    as the SpeCache tests and chunkbench run them: the interpreter's exit is silent."""
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from tqdm import tqdm
        from chunkcache.models import tiny_model
        from conftest import sglang_engine

        if __name__ == "__main__":
            model = tiny_model("llama")
            for i in range(2):
                with sglang_engine(model, Path({str(tmp_path)!r}), max_total_tokens=2048) as engine:
                    print(engine.generate(input_ids=[5, 6, 7], sampling_params={{"max_new_tokens": 2}})["output_ids"])
                for _ in tqdm(range(2)):
                    pass
    """)
    out = run("-c", script, timeout=1200)
    assert out.returncode == 0 and out.stdout.count("[") == 2, out.stderr[-3000:]
    assert "resource_tracker" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
