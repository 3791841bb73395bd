"""`chunkcache bench` / `chunkcache eval` reach the harness through the `chunkcache.commands` entry points, so the
SGLang glue never imports it (tests/test_import_graph.py); a missing harness is a clear error, not a traceback."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from sglang_patch.serve import cli


def _installed(monkeypatch, *eps: EntryPoint) -> None:
    monkeypatch.setattr(cli, "entry_points", lambda group: [ep for ep in eps if ep.group == group])


def test_the_harness_commands_are_installed_entry_points():
    from chunkbench import commands as harness

    assert cli.installed_commands() == {"bench": harness.bench, "eval": harness.evaluate,
                                        "calibrate": harness.calibrate}


def record(argv: list[str]) -> int:
    """Records its arguments."""
    record.argv = argv
    return 7


def test_a_command_gets_the_rest_of_the_arguments_and_its_status_is_the_exit_status(monkeypatch, capsys):
    _installed(monkeypatch, EntryPoint("rec", f"{__name__}:record", cli.COMMANDS))
    assert cli.main(["rec", "--smoke", "x"]) == 7 and record.argv == ["--smoke", "x"]
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "Records its arguments." in capsys.readouterr().out


def test_a_missing_harness_is_an_error_naming_it_and_the_other_commands_still_work(monkeypatch, capsys, tmp_path):
    _installed(monkeypatch, EntryPoint("bench", "chunkbench_absent.cli:bench", cli.COMMANDS))
    assert cli.main(["bench", "--smoke"]) == 2
    err = capsys.readouterr().err
    assert ("`chunkcache bench` is unavailable: chunkbench_absent.cli:bench cannot be loaded: ModuleNotFoundError: "
            "No module named 'chunkbench_absent'") in err
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert cli.main(["model", str(model)]) == 0  # ... while the rest of the CLI runs without it


def test_serve_reads_the_model_and_the_config_that_sglang_will_serve(monkeypatch, capsys, tmp_path):
    """`--model-path` (SGLang's spelling) is the model the architecture check judges, and $CHUNKCACHE_CONFIG, which
    the scheduler reads, is the file `serve` builds SGLang's flags from: a bad value in it stops `serve` first."""
    from chunkcache.models import tiny_model

    assert cli.main(["serve", "--model-path", str(tiny_model("gemma2"))]) == 2
    assert "soft-capping" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("select: {ratio: 7}\n")
    monkeypatch.setenv("CHUNKCACHE_CONFIG", str(bad))
    assert cli.main(["serve"]) == 2
    assert "select:ratio: must be in [0, 1], got 7" in capsys.readouterr().err



def test_sglangs_own_config_passes_through_and_chunkcaches_has_its_own_flag(capsys, tmp_path):
    """`--config` is SGLang's (a YAML of its flags, read as its launcher reads it: the checks before start judge what
    it holds); chunkcache's file is `--chunkcache-config`."""
    sglang_yaml = tmp_path / "sglang.yaml"
    sglang_yaml.write_text("tp-size: 2\n")  # SmolLM2-135M's 9 query heads do not split over 2 ranks
    assert cli.main(["serve", "--config", str(sglang_yaml)]) == 2
    assert "heads that do not split evenly" in capsys.readouterr().err
    ours = tmp_path / "chunkcache.yaml"
    ours.write_text("select: {ratio: 7}\n")
    assert cli.main(["serve", "--chunkcache-config", str(ours)]) == 2
    assert "select:ratio: must be in [0, 1], got 7" in capsys.readouterr().err

def test_the_benchmarks_measure_the_selector_the_server_serves(capsys):
    """Both harness commands' --help give the server's selector among their default selectors."""
    from chunkbench import commands
    from chunkcache.config import Config

    for run in (commands.bench, commands.evaluate):
        with pytest.raises(SystemExit):
            run(["--help"])
        text = " ".join(capsys.readouterr().out.split())
        selectors = text.split("--selectors SELECTORS", 2)[-1].split("--ratios")[0]
        assert f"default: {Config().select.selector}" in selectors or f",{Config().select.selector})" in selectors


class _StoreServer(BaseHTTPRequestHandler):
    """Answers chat requests as a chunkcache server does on documents it has seen: each document a miss the first
    time, a hit after. A subclass per test holds the documents seen and the requests' bodies."""

    seen: set[str]
    bodies: list[dict]

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append({"path": self.path, **body})
        docs = body["chunkcache"]["documents"]
        hits = sum(doc in self.seen for doc in docs)
        self.seen.update(docs)
        answer = json.dumps({"chunkcache": {"chunk_hits": hits, "chunk_misses": len(docs) - hits}})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(answer.encode())

    def log_message(self, *args):
        pass


def test_serve_prints_a_quick_start_that_reuses_the_documents_in_another_order():
    """What `serve` prints once the server answers, pasted into a shell, sends the checkout's example documents, then
    the same documents reversed, and prints each answer's chunk report: the second's hits."""
    handler = type("Handler", (_StoreServer,), {"seen": set(), "bodies": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        usage = cli._usage(f"http://127.0.0.1:{server.server_port}")
        command = usage[usage.index(sys.executable):]  # what a user pastes: the command and its program
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 0, out.stderr
    docs = [p.read_text() for p in sorted((Path(__file__).parents[1] / "examples" / "documents").glob("*.txt"))]
    assert len(docs) == 5
    assert [(b["path"], b["chunkcache"]["documents"]) for b in handler.bodies] == [
        ("/v1/chat/completions", docs), ("/v1/chat/completions", docs[::-1])]
    first, second = out.stdout.splitlines()
    assert "'chunk_hits': 0, 'chunk_misses': 5" in first and "'chunk_hits': 5, 'chunk_misses': 0" in second


def test_the_quick_start_asks_for_a_directory_where_there_is_no_checkout(monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "sglang_patch" / "serve" / "cli.py"))
    usage = cli._usage("http://127.0.0.1:30000")
    assert f"{sys.executable} - DIR <<'PY'" in usage and "DIR a directory of .txt documents" in usage
