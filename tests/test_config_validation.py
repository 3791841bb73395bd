"""Config values are checked when the config is loaded: `select: {selector: bogus, ratio: 7}` or `store: {host_bytes:
"2 gigs", disk_bytes: -5}`, in the file or in a CHUNKCACHE_<SECTION>__<KEY> variable, stop `chunkcache serve` before
SGLang starts, naming the key (and the variable) and the reason. Loaded, they would start a server that falls back on
every hinted request. Keys and variables that name no knob stop it too, unless `config.unknown_keys: warn` (a
rollback's older version serving a newer config) makes them a warning. docs/configuration.md is generated from the
config's dataclasses and checked here; the effective config /server_info shows masks every secret."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chunkcache import config as config_module
from chunkcache.config import DOC, MASK, PACKAGED, Config, ConfigError, env_name, parse_bytes, sections
from chunkcache.config_reference import COMMAND, format_bytes, reference
from chunkcache.select import REGISTRY



@pytest.mark.parametrize("body, message", [
    ("select: {selector: bogus}", "select:selector: 'bogus' is not one of"),
    ("select: {ratio: 7}", "select:ratio: must be in [0, 1], got 7.0"),
    ("select: {ratio: '0.2'}", "select:ratio: must be float, got '0.2' (str)"),
    ("select: {options: {bogus: {}}}", "select:options: 'bogus' is not a selector"),
    ("select: {options: {spec: 3}}", "select:options:spec: must be a mapping"),
    ("store: {host_bytes: 2 gigs}", "store:host_bytes: must be a byte size: an int, or a number and a unit of B, "
                                    "kB, MB, GB, TB, KiB, MiB, GiB, TiB (2GiB, 512 MiB, 1.5GB), got '2 gigs'"),
    ("store: {disk_bytes: 2G}", "store:disk_bytes: must be a byte size"),
    ("store: {remote_max_value_bytes: 1.5B}", "store:remote_max_value_bytes: must be a byte size"),
    ("store: {disk_bytes: -5}", "store:disk_bytes: must be at least 1, got -5"),
    ("store: {host_bytes: 2.5}", "store:host_bytes: must be a byte size"),
    ("store: {host_bytes: -1GiB}", "store:host_bytes: must be a byte size"),
    ("store: {host_bytes: -1}", "store:host_bytes: must be at least 0, got -1"),
    ("store: {namespace: ''}", "store:namespace: must be a non-empty string"),
    ("store: {disk_dir: 5}", "store:disk_dir: must be str or null, got 5 (int)"),
    ("serve: {port: 70000}", "serve:port: must be in [1, 65535], got 70000"),
    ("serve: {port: true}", "serve:port: must be int, got True (bool)"),
    ("serve: {mem_fraction_static: 0}", "serve:mem_fraction_static: must be in (0, 1], got 0"),
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
    path.write_text("select: {selector: bogus, ratio: 7}\nstore: {host_bytes: '2 gigs', disk_bytes: -5}\n")
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "sglang_patch.serve.cli", "serve", "--chunkcache-config", str(path),
                          "--port", "1"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "CHUNKCACHE_AUTO__ENABLD": "true"})
    assert out.returncode == 2, out.stdout + out.stderr
    for message in ("select:selector: 'bogus' is not one of", "store:host_bytes: must be a byte size",
                    "store:disk_bytes: must be at least 1, got -5",
                    "$CHUNKCACHE_AUTO__ENABLD: names no config knob (did you mean $CHUNKCACHE_AUTO__ENABLED?)"):
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


@pytest.mark.parametrize("text, size", [
    ("2GiB", 2 << 30), ("512 MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("300MB", 300_000_000), ("4096", 4096),
    (4096, 4096), ("1kib", 1024), (" 2 TB ", 2 * 10**12), ("7 B", 7), ("1.1GiB", int(1.1 * 2**30)),
])
def test_byte_sizes_take_si_and_iec_units(tmp_path, text, size):
    path = tmp_path / "sizes.yaml"
    path.write_text(f"store: {{host_bytes: {text!r}, disk_bytes: {text!r}, remote_max_value_bytes: {text!r}}}")
    store = Config.load(path).store
    assert store.host_bytes == store.disk_bytes == store.remote_max_value_bytes == size
    assert type(store.host_bytes) is int  # what the store reads


def test_the_packaged_default_writes_its_byte_sizes_readably():
    assert "host_bytes: 2GiB" in (PACKAGED / "default.yaml").read_text()
    assert Config.load().store.host_bytes == Config().store.host_bytes == 2 << 30


@pytest.mark.parametrize("size", [0, 1, 1000, 1024, 2 << 30, 3 * 2**40, 5 * 2**20 + 1])
def test_the_reference_writes_a_byte_size_that_reads_back(size):
    assert parse_bytes(format_bytes(size), "k") == size
    assert format_bytes(2 << 30) == "2GiB" and format_bytes(1000) == "1000"


@pytest.fixture
def env(monkeypatch):
    """Sets variables for one test, none of this process's own CHUNKCACHE_..._... knobs left in."""
    for var in [v for v in os.environ if v.startswith("CHUNKCACHE_") and "__" in v]:
        monkeypatch.delenv(var)
    return monkeypatch.setenv


def test_a_variable_overrides_the_files_knob_and_is_typed(env, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("select: {ratio: 0.5, selector: epic}\nstore: {host_bytes: 1GiB}\n")
    env("CHUNKCACHE_SELECT__RATIO", "0.2")
    env("CHUNKCACHE_STORE__HOST_BYTES", "4GiB")
    env("CHUNKCACHE_AUTO__ENABLED", "true")
    env("CHUNKCACHE_DECODE__SPECACHE__BITS", "2")
    env("CHUNKCACHE_SERVE__SGLANG_ARGS", "[--tp-size, '2']")
    env("CHUNKCACHE_SELECT__OPTIONS", "{mix: {mass: 0.8, overlap: 0}}")
    config = Config.load(path, selectors=REGISTRY)
    assert config.select.ratio == 0.2 and config.select.selector == "epic"  # the file's other keys stay
    assert config.store.host_bytes == 4 << 30 and config.auto.enabled is True and config.decode.specache.bits == 2
    assert config.serve.sglang_args == ["--tp-size", "2"]
    assert config.select.options["mix"] == {"stored_deviation": True, "overlap": 0, "mass": 0.8}
    env("CHUNKCACHE_STORE__DISK_DIR", "null")
    env("CHUNKCACHE_SERVE__MAX_TOTAL_TOKENS", "4096")
    config = Config.load("bench-cpu")  # a section the file does not have, and one it has
    assert config.store.disk_dir is None and config.serve.max_total_tokens == 4096
    assert config.serve.mem_fraction_static == 0.95


@pytest.mark.parametrize("var, value, message", [
    ("CHUNKCACHE_SELECT__RATIO", "7", "$CHUNKCACHE_SELECT__RATIO (select:ratio): must be in [0, 1], got 7.0"),
    ("CHUNKCACHE_SELECT__RATIO", "'0.2'", "$CHUNKCACHE_SELECT__RATIO (select:ratio): must be float, got '0.2' (str)"),
    ("CHUNKCACHE_STORE__HOST_BYTES", "2 gigs", "$CHUNKCACHE_STORE__HOST_BYTES (store:host_bytes): must be a byte size"),
    ("CHUNKCACHE_SERVE__PORT", "yes", "$CHUNKCACHE_SERVE__PORT (serve:port): must be int, got True (bool)"),
    ("CHUNKCACHE_SELECT__SELECTOR", "bogus", "$CHUNKCACHE_SELECT__SELECTOR (select:selector): 'bogus' is not one of"),
    ("CHUNKCACHE_SELECT__OPTIONS", "{spec: 3}", "$CHUNKCACHE_SELECT__OPTIONS (select:options:spec): must be a mapping"),
    ("CHUNKCACHE_DECODE__SPECACHE__BITS", "3", "$CHUNKCACHE_DECODE__SPECACHE__BITS (decode:specache:bits): must be 1"),
    ("CHUNKCACHE_SERVE__PORT", "{", "$CHUNKCACHE_SERVE__PORT: not a YAML value"),
    ("CHUNKCACHE_AUTO__ENABLD", "true", "$CHUNKCACHE_AUTO__ENABLD: names no config knob (did you mean "
                                        "$CHUNKCACHE_AUTO__ENABLED?)"),
    ("CHUNKCACHE_STOR__HOST_BYTES", "1", "$CHUNKCACHE_STOR__HOST_BYTES: names no config knob (did you mean "
                                        "$CHUNKCACHE_STORE__HOST_BYTES?)"),
    ("CHUNKCACHE_DECODE__SPECACHE", "{}", "$CHUNKCACHE_DECODE__SPECACHE: names no config knob"),
    ("CHUNKCACHE_SELECT__RATIO__X", "1", "$CHUNKCACHE_SELECT__RATIO__X: names no config knob"),
    ("CHUNKCACHE_QQQ__ZZZ", "1", "$CHUNKCACHE_QQQ__ZZZ: names no config knob (docs/configuration.md)"),
])
def test_a_bad_variable_is_refused_naming_it(env, var, value, message):
    env(var, value)
    with pytest.raises(ValueError) as info:
        Config.load(selectors=REGISTRY)
    assert message in str(info.value)


def test_variables_without_a_double_underscore_are_no_knobs(env, tmp_path):
    """$CHUNKCACHE_CONFIG names the file, $CHUNKCACHE_HOME the cache, $CHUNKCACHE_REMOTE_URL a store URL: none is
    read as a knob (nor refused as a misspelt one)."""
    for var in ("CHUNKCACHE_CONFIG", "CHUNKCACHE_HOME", "CHUNKCACHE_REMOTE_URL", "CHUNKCACHE_AUTO_CHUNKS",
                "CHUNKCACHE_SELECT_RATIO"):
        env(var, "7")
    assert Config.load().to_dict() == Config().to_dict()


def test_the_servers_every_process_reads_the_file_and_the_variables(env, tmp_path):
    """The scheduler (launcher.load_server_config, from $CHUNKCACHE_CONFIG) and `chunkcache serve`
    (launcher.load_config) go through Config.load, variables included."""
    from sglang_patch.serve import launcher

    path = tmp_path / "c.yaml"
    path.write_text("select: {ratio: 0.5}\nlimits: {max_spans: 8}\n")
    env(launcher.CONFIG_ENV, str(path))
    env("CHUNKCACHE_LIMITS__MAX_SPANS", "9")
    for config in (launcher.load_server_config(), launcher.load_config(str(path))):
        assert (config.select.ratio, config.limits.max_spans) == (0.5, 9)


def test_every_knob_has_a_doc_line_and_a_variable_that_sets_it(env):
    """Each knob's variable, set to the default the reference shows, loads the built-in default: every knob is
    reachable by its variable and the reference's defaults are what a config may write."""
    knobs = [((*path, f.name), f) for path, _, fields in sections() for f in fields]
    assert ("decode", "specache", "bits") in dict(knobs) and ("store", "host_bytes") in dict(knobs)
    for knob_path, f in knobs:
        assert f.metadata.get(DOC, "").strip(), f"{'.'.join(knob_path)} has no doc line"
    table = {row.split(" | ")[0].strip("|` "): row.split(" | ")[2].strip("`")
             for row in reference().splitlines() if row.startswith("| `")}
    for knob_path, _ in knobs:
        env(env_name(knob_path), table[".".join(knob_path)])
    assert Config.load(PACKAGED / "eval-fp32.yaml").to_dict() == Config().to_dict()


def test_the_configuration_page_is_generated_from_the_code():
    page = Path(__file__).parents[1] / "docs" / "configuration.md"
    assert page.read_text() == reference(), f"docs/configuration.md is stale: run `{COMMAND}`"


# --- what /server_info shows: the effective config, its secrets masked ------------------------------------------------


def test_the_effective_config_is_every_knob_with_each_secret_masked():
    """A URL's password (user:password@, :password@, a cluster's seeds, a `password=` parameter) and the value of
    SGLang's secret flags (--api-key X, --admin-api-key=X, --ssl-keyfile-password X) are MASK; every other value is
    the config's own."""
    config = Config()
    assert config.effective() == config.to_dict()  # nothing secret: the config as it is
    config.store.remote_url = "rediss+cluster://:s3cret-a@node1:6379,node2:6379"
    config.serve.sglang_args = ["--api-key", "s3cret-b", "--admin-api-key=s3cret-c", "--tp-size", "2",
                                "--max-prefill-tokens", "4096", "--ssl-keyfile-password", "s3cret-d"]
    config.audit.cases = "redis://user:s3cret-e@host:6379/0?password=s3cret-f&db=1"  # any string is looked at
    shown = config.effective()
    assert "s3cret" not in json.dumps(shown)
    assert shown["store"]["remote_url"] == f"rediss+cluster://:{MASK}@node1:6379,node2:6379"
    assert shown["serve"]["sglang_args"] == ["--api-key", MASK, f"--admin-api-key={MASK}", "--tp-size", "2",
                                             "--max-prefill-tokens", "4096", "--ssl-keyfile-password", MASK]
    assert shown["audit"]["cases"] == f"redis://user:{MASK}@host:6379/0?password={MASK}&db=1"
    for section, key in (("store", "remote_url"), ("serve", "sglang_args"), ("audit", "cases")):
        shown[section][key] = config.to_dict()[section][key]
    assert shown == config.to_dict()  # nothing else changed


# --- config.unknown_keys: a config written for a newer version, served by an older one ------------------------------

NEWER = "select: {ratio: 0.3, future_knob: 1}\nfuture_section: {a: 1}\n"  # two keys this version has no knob for


def test_unknown_keys_are_refused_by_default_all_at_once(env, tmp_path):
    path = tmp_path / "newer.yaml"
    path.write_text(NEWER)
    with pytest.raises(ValueError) as info:
        Config.load(path, selectors=REGISTRY)
    assert f"{path}: unknown key(s) ['future_section']" in str(info.value)
    assert f"{path}:select: unknown key(s) ['future_knob']" in str(info.value)


@pytest.mark.parametrize("mode", ["file", "variable"])
def test_unknown_keys_warn_naming_them_and_the_known_keys_load(env, tmp_path, caplog, mode):
    """`config.unknown_keys: warn`, in the file or as $CHUNKCACHE_CONFIG__UNKNOWN_KEYS: one WARNING naming every key
    and variable that names no knob; the rest is served as written."""
    path = tmp_path / "newer.yaml"
    path.write_text(NEWER + ("config: {unknown_keys: warn}\n" if mode == "file" else ""))
    if mode == "variable":
        env("CHUNKCACHE_CONFIG__UNKNOWN_KEYS", "warn")
    env("CHUNKCACHE_SELECT__FUTURE_VAR", "2")
    with caplog.at_level("WARNING", logger="chunkcache.config"):
        config = Config.load(path, selectors=REGISTRY)
    assert config.select.ratio == 0.3 and config.config.unknown_keys == "warn"
    assert config.to_dict() == {**Config().to_dict(), "select": {**Config().to_dict()["select"], "ratio": 0.3},
                                "config": {"unknown_keys": "warn"}}
    (record,) = [r for r in caplog.records if r.name == "chunkcache.config"]
    assert record.levelname == "WARNING"
    for named in ("['future_section']", "select: unknown key(s) ['future_knob']", "$CHUNKCACHE_SELECT__FUTURE_VAR"):
        assert named in record.getMessage()


def test_warn_mode_skips_unknown_keys_only_not_bad_values(env, tmp_path):
    path = tmp_path / "newer.yaml"
    path.write_text("config: {unknown_keys: warn}\nselect: {ratio: 7, future_knob: 1}\n")
    with pytest.raises(ValueError, match=r"select:ratio: must be in \[0, 1\], got 7.0") as info:
        Config.load(path, selectors=REGISTRY)
    assert "future_knob" not in str(info.value)
    path.write_text("config: {unknown_keys: warm}\n")
    with pytest.raises(ValueError, match="config:unknown_keys: 'warm' is not one of error, warn"):
        Config.load(path)


def test_serve_starts_on_a_newer_config_in_warn_mode(tmp_path):
    """`chunkcache serve`'s own load: the unknown key is a WARNING and the start goes on past the config (to the
    model, here a directory that does not exist, where it stops) instead of stopping on the key."""
    path = tmp_path / "newer.yaml"
    path.write_text(NEWER + "config: {unknown_keys: warn}\n")
    out = subprocess.run([sys.executable, "-m", "sglang_patch.serve.cli", "serve", "--chunkcache-config", str(path),
                          "--model", str(tmp_path / "no-model"), "--port", "1"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "WARNING" in out.stderr and "select: unknown key(s) ['future_knob']" in out.stderr
    (error,) = [line for line in out.stderr.splitlines() if line.startswith("chunkcache: error:")]
    assert "no-model" in error and "future" not in error
    assert "starting:" not in out.stdout
