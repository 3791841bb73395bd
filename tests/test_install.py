"""Installing chunkcache into an environment that holds SGLang's own set of packages moves none of them.

pip resolves two sets, installing nothing (`--dry-run --ignore-installed --report`): `sglang==PIN` alone, what an
SGLang environment holds, and the same with the chunkcache wheel built from this tree (plain, and with the extras an
SGLang environment may take: router, bench, frameworks). A package both sets hold must have the same version in both;
the wheel may only add packages. Both resolutions run on this interpreter and platform, so environment
markers select the same requirements on both sides: a difference is the wheel's requirements, nothing else.
The first set is what SGLang resolves to today, newest releases first: an environment installed earlier holds older
ones, which the wheel keeps wherever its ranges' floors (pyproject.toml) allow.

Needs the package index pip is configured with (PyPI): without it the test skips, saying so."""

import json
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SGLANG = next(r for r in map(Requirement, tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                             ["dependencies"]) if r.name == "sglang")
# A pip that reads a wheel's requirements without downloading it: from the index's metadata file (PEP 658) or, where
# the index serves none, by HTTP range requests (fast-deps). The project's own pip (23.2) downloads every wheel of
# SGLang's set for a dry run, CUDA libraries included: ~1.5 GB and 2.5-4.5 minutes per resolution, ~1.5 with this one.
RESOLVER_PIP = "pip==26.3"
PIP_TIMEOUT_S = 600


def run(*argv) -> subprocess.CompletedProcess:
    return subprocess.run(list(map(str, argv)), capture_output=True, text=True, timeout=PIP_TIMEOUT_S)


@pytest.fixture(scope="module")
def pip(tmp_path_factory) -> list[str]:
    """The command of RESOLVER_PIP, in a venv of its own. Skips the module's tests when pip's package index cannot
    be reached or lacks the pinned SGLang."""
    env = tmp_path_factory.mktemp("resolver")
    venv.EnvBuilder(with_pip=True).create(env)
    command = [str(env / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    upgrade = run(*command, "install", "--quiet", RESOLVER_PIP)
    versions = run(*command, "index", "versions", SGLANG.name) if upgrade.returncode == 0 else upgrade
    if versions.returncode != 0 or str(next(iter(SGLANG.specifier)).version) not in versions.stdout:
        pytest.skip(f"pip's package index cannot be reached or lacks {SGLANG}: pip said "
                    f"{(versions.stdout + versions.stderr).strip()[-400:]!r}")
    return command


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the tree (its requirements are what matters here)."""
    tmp = tmp_path_factory.mktemp("install")
    shutil.copytree(ROOT, tmp / "src", ignore=shutil.ignore_patterns(".*", "*.egg-info", "build", "dist", "results",
                                                                      "__pycache__", "tests", "docs", "examples"))
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", tmp / "dist",
                        tmp / "src"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return next((tmp / "dist").glob("chunkcache-*.whl"))


def resolved(pip: list[str], report: Path, *requirements) -> dict[str, str]:
    """name -> version of every package pip would install for `requirements` into an empty environment."""
    r = run(*pip, "install", "--dry-run", "--ignore-installed", "--use-feature=fast-deps", "--quiet", "--report",
            report, *requirements)
    assert r.returncode == 0, f"pip could not resolve {requirements}:\n{r.stderr[-3000:]}"
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


@pytest.fixture(scope="module")
def sglang_set(pip, tmp_path_factory) -> dict[str, str]:
    return resolved(pip, tmp_path_factory.mktemp("sglang") / "report.json", SGLANG)


@pytest.mark.parametrize("extras", ["", "[router,bench,frameworks]"])
def test_the_wheel_moves_no_package_of_sglangs_set(pip, sglang_set, wheel, tmp_path, extras):
    sglang = sglang_set
    both = resolved(pip, tmp_path / "report.json", SGLANG, f"chunkcache{extras} @ {wheel.as_uri()}")
    moved = {name: f"{sglang[name]} -> {both[name]}" for name in sglang.keys() & both.keys()
             if sglang[name] != both[name]}
    added = {name: both[name] for name in both.keys() - sglang.keys()}
    print(f"SGLang's set: {len(sglang)} packages; the wheel{extras} adds {json.dumps(added, sort_keys=True)}")
    assert not moved, f"installing chunkcache{extras} moves packages of SGLang's set: {moved}"
    assert sglang.keys() <= both.keys() and "chunkcache" in added
