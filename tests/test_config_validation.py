"""Config values are checked when the file is loaded: `select: {selector: bogus, ratio: 7}` or `store: {host_bytes:
"2GB", disk_bytes: -5}` stop `chunkcache serve` before SGLang starts, naming the key and the reason. Loaded, they
would start a server that falls back on every hinted request."""

import subprocess
import sys
import time

import pytest

from chunkcache import config as config_module
from chunkcache.config import PACKAGED, Config, ConfigError
from chunkcache.select import REGISTRY



@pytest.mark.parametrize("body, message", [
    ("select: {selector: bogus}", "select:selector: 'bogus' is not one of"),
    ("select: {ratio: 7}", "select:ratio: must be in [0, 1], got 7.0"),
    ("select: {ratio: '0.2'}", "select:ratio: must be float, got '0.2' (str)"),
    ("select: {options: {bogus: {}}}", "select:options: 'bogus' is not a selector"),
    ("select: {options: {spec: 3}}", "select:options:spec: must be a mapping"),
    ("store: {host_bytes: 2GB}", "store:host_bytes: must be int, got '2GB' (str)"),
    ("store: {disk_bytes: -5}", "store:disk_bytes: must be at least 1, got -5"),
    ("store: {host_bytes: 2.5}", "store:host_bytes: must be int, got 2.5 (float)"),
    ("store: {namespace: ''}", "store:namespace: must be a non-empty string"),
    ("store: {disk_dir: 5}", "store:disk_dir: must be str or null, got 5 (int)"),
    ("serve: {port: 70000}", "serve:port: must be in [1, 65535], got 70000"),
    ("serve: {port: true}", "serve:port: must be int, got True (bool)"),
    ("serve: {mem_fraction_static: 0}", "serve:mem_fraction_static: must be in (0, 1], got 0.0"),
    ("serve: {dtype: fp8}", "serve:dtype: 'fp8' is not one of"),
    ("serve: {sglang_args: [--foo, 1]}", "serve:sglang_args: must be a list of strings"),
    ("serve: {sleep_on_idle: 'yes'}", "serve:sleep_on_idle: must be bool"),
    ("draft: {layers: 0}", "draft:layers: must be at least 1, got 0"),
    ("draft: {dtype: int8}", "draft:dtype: 'int8' is not one of"),
    ("limits: {max_spans: 0}", "limits:max_spans: must be at least 1, got 0"),
    ("limits: {ingest_in_flight: -1}", "limits:ingest_in_flight: must be at least 1"),
    ("store: [1, 2]", "'store' must be a mapping"),
    ("stor: {}", "unknown key(s) ['stor']"),
])
def test_bad_values_are_refused_with_the_key(tmp_path, body, message):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ValueError) as info:
        Config.load(path, selectors=REGISTRY)
    assert message in str(info.value) and str(path) in str(info.value)


def test_good_values_load_and_ints_become_floats(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("select: {selector: epic, ratio: 1}\nstore: {host_bytes: 0, disk_bytes: 1}\nserve: {port: 1}\n"
                    "draft: {layers: null}\nlimits: {max_spans: 1}")
    config = Config.load(path)
    assert config.select.ratio == 1.0 and isinstance(config.select.ratio, float) and config.store.host_bytes == 0


@pytest.mark.parametrize("name", sorted(p.stem for p in PACKAGED.glob("*.yaml")))
def test_packaged_configs_load_by_name(name):
    assert Config.load(name).to_dict() == Config.load(PACKAGED / f"{name}.yaml").to_dict()


def test_packaged_configs_are_found():  # else the test above runs on none
    assert {p.stem for p in PACKAGED.glob("*.yaml")} == {"default", "bench-cpu", "eval-fp32"}


@pytest.mark.parametrize("name", ["bench-gpu", "configs/bench-cpu.yaml"])
def test_a_missing_config_is_an_error_naming_the_packaged_ones(name):
    with pytest.raises(FileNotFoundError, match=f"config '{name}': no file .*packaged configs: bench-cpu, default"):
        Config.load(name)


def test_no_packaged_default_is_an_error_not_the_built_in_defaults(monkeypatch, tmp_path):
    monkeypatch.setattr(config_module, "PACKAGED", tmp_path)
    with pytest.raises(FileNotFoundError, match="config 'default'.*packaged configs: none"):
        Config.load()


def test_config_error_names_key_and_reason():
    err = ConfigError("f.yaml:select:ratio", "must be in [0, 1], got 7.0")
    assert (err.key, str(err)) == ("f.yaml:select:ratio", "f.yaml:select:ratio: must be in [0, 1], got 7.0")


def test_serve_refuses_a_bad_config_before_starting_sglang(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("select: {selector: bogus, ratio: 7}\nstore: {host_bytes: '2GB', disk_bytes: -5}\n")
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "sglang_patch.serve.cli", "serve", "--config", str(path),
                          "--port", "1"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    for message in ("select:selector: 'bogus' is not one of", "store:host_bytes: must be int, got '2GB'",
                    "store:disk_bytes: must be at least 1, got -5"):
        assert message in out.stderr
    assert "starting:" not in out.stdout
    assert time.time() - t0 < 60


def test_a_selectors_options_merge_over_the_shipped_ones(tmp_path):
    """Setting one mix option keeps the shipped remembered deviation and overlap (a config once replaced the whole
    dict and silently lost both); a shipped option is turned off by setting it."""
    path = tmp_path / "c.yaml"
    path.write_text("select:\n  options:\n    mix: {mass: 0.46}\n    spec: {layers: 2}\n")
    options = Config.load(path).select.options
    assert options["mix"] == {"stored_deviation": True, "overlap": 0.15, "mass": 0.46}
    assert options["spec"] == {"layers": 2}
    path.write_text("select:\n  options:\n    mix: {overlap: 0}\n")
    assert Config.load(path).select.options["mix"] == {"stored_deviation": True, "overlap": 0}
    assert Config().select.options == Config.load().select.options  # the packaged file states what ships
