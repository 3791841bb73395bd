"""`chunkcache bench` / `chunkcache eval` reach the harness through the `chunkcache.commands` entry points, so the
SGLang glue never imports it (tests/test_import_graph.py); a missing harness is a clear error, not a traceback."""

from importlib.metadata import EntryPoint

import pytest

from sglang_patch.serve import cli


def _installed(monkeypatch, *eps: EntryPoint) -> None:
    monkeypatch.setattr(cli, "entry_points", lambda group: [ep for ep in eps if ep.group == group])


def test_the_harness_commands_are_installed_entry_points():
    from chunkbench import commands as harness

    assert cli.installed_commands() == {"bench": harness.bench, "eval": harness.evaluate}


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
