"""The wheel is the product: built the way a release is (`python -m build`: the sdist, then the wheel from
it), installed with `--no-deps` into a fresh venv, it serves hinted requests with chunk reuse through SGLang's own
command, `python -m sglang.launch_server --model-path DIR --radix-cache-backend chunkcache`, and nothing else: no
Makefile step, no `chunkcache serve`, no CHUNKCACHE_CONFIG, no CPU flags. The venv sees this venv's site-packages
(SGLang, torch) through a plain path line, which runs none of its .pth files: the kernel guard comes from the wheel,
and the project's editable install stays out of it."""

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import requests

from sglang_patch.serve.server_process import ServerProcess, free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CHUNKS = ["The river Vell flows north through the town of Amber.\n\n",
          "Amber's market opens every Tuesday at dawn.\n\n"]


@pytest.fixture(scope="module")
def wheel_python(tmp_path_factory) -> Path:
    """The python of a fresh venv holding the wheel and nothing else of chunkcache."""
    tmp = tmp_path_factory.mktemp("wheel")
    # a copy without what earlier builds left: setuptools would take the file list of a stale *.egg-info as the sdist's
    shutil.copytree(ROOT, tmp / "src", ignore=shutil.ignore_patterns(".*", "*.egg-info", "build", "dist", "results",
                                                                      "__pycache__"))
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp / "dist", tmp / "src")
    venv.EnvBuilder(with_pip=False).create(tmp / "venv")
    python = tmp / "venv" / "bin" / "python"
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    (site / "project_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        next((tmp / "dist").glob("chunkcache-*.whl")))
    return python


def run(*argv, cwd=None) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, cwd=cwd)
    assert r.returncode == 0, f"{' '.join(map(str, argv))}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_the_wheel_holds_the_guard_the_configs_and_the_plugin(wheel_python):
    code = ("import sys, chunkcache, sglang_patch.kernel_guard as g; from importlib.metadata import entry_points; "
            "from chunkcache.config import Config; Config.load(); Config.load('bench-cpu'); "
            "print(chunkcache.__file__); print(any(isinstance(f, g.SglKernelFinder) for f in sys.meta_path)); "
            "print([e.value for e in entry_points(group='sglang.srt.plugins', name='chunkcache')])")
    out = run(wheel_python, "-c", code, cwd=wheel_python.parents[2]).splitlines()
    assert Path(out[0]).is_relative_to(wheel_python.parents[1]), f"chunkcache imported from {out[0]}, not the wheel"
    assert out[1] == "True", "the kernel guard's .pth did not run at interpreter start"
    assert out[2] == "['sglang_patch.plugin:register']"


def test_the_stock_command_serves_chunk_reuse_on_this_host(wheel_python, default_model, monkeypatch):
    for var in ("SGLANG_USE_CPU_ENGINE", "CHUNKCACHE_CONFIG", "PYTHONPATH"):  # what earlier tests may have set
        monkeypatch.delenv(var, raising=False)
    port = free_port()
    argv = [wheel_python, "-m", "sglang.launch_server", "--model-path", default_model,
            "--radix-cache-backend", "chunkcache", "--port", str(port)]
    log = wheel_python.parents[2] / "server.log"
    with ServerProcess(argv, url=f"http://127.0.0.1:{port}", log_path=log, cwd=wheel_python.parents[2]) as server:
        server.wait_healthy(600)
        first, second = generate(server.url, CHUNKS), generate(server.url, CHUNKS[::-1])
    assert first is not None and second is not None, f"a hinted request was not blended; log {log}"
    assert first["chunk_misses"] == len(CHUNKS)
    assert second["chunk_hits"] == len(CHUNKS) and second["reused_tokens"] > 0, second


def generate(url: str, chunks: list[str]) -> dict | None:
    """A hinted request for `chunks` in this order; its meta_info["chunkcache"] report."""
    text, spans = "Answer from the passages.\n\n", []
    for chunk in chunks:
        spans.append([len(text), len(text) + len(chunk)])
        text += chunk
    hint = {"protocol_version": "1", "message_id": "m", "actions": [{
        "action_id": "c", "action_type": "chunkcache.chunks", "action_version": "1",
        "payload": {"char_spans": spans}}]}
    r = requests.post(url + "/generate", timeout=600, json={
        "text": text + "Question: on which day does the market open?\nAnswer:", "kv_hints": hint,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    r.raise_for_status()
    return r.json()["meta_info"].get("chunkcache")
