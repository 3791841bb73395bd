"""docs/configuration.md, generated from chunkcache/config.py: a table per section of every knob's key, type,
default, doc line and environment variable. tests/test_config_validation.py fails when the page and the code differ;
regenerate it with `python -m chunkcache.config_reference > docs/configuration.md`."""

from __future__ import annotations

import json
from typing import Any

from .config import BYTE_UNITS, DOC, env_name, sections

COMMAND = "python -m chunkcache.config_reference > docs/configuration.md"

INTRO = f"""# Configuration reference

Every knob of a chunkcache server, with its default and what it sets. Generated from `chunkcache/config.py`, where
each knob's doc line is its field's: edit the doc there, then run

    {COMMAND}

(`tests/test_config_validation.py` fails while this page and the code differ).

## Where a setting comes from

Each source overrides the ones before it:

1. the default (below), which the packaged `default` config (`chunkcache/configs/default.yaml`) states too;
2. the config file: `chunkcache serve --chunkcache-config FILE|NAME` (a path, or a packaged name: `default`, `bench-cpu`,
   `eval-fp32`), else `$CHUNKCACHE_CONFIG`, else the packaged `default`; every key is optional;
3. one environment variable per knob, `CHUNKCACHE_<SECTION>__<KEY>` (a double underscore before each key; the last
   column below), its value read as YAML: `CHUNKCACHE_SELECT__RATIO=0.2`, `CHUNKCACHE_STORE__HOST_BYTES=4GiB`,
   `CHUNKCACHE_AUTO__ENABLED=true`, `CHUNKCACHE_STORE__DISK_DIR=null` (an empty value is null too). A variable of
   that form that names no knob is an error, like an unknown file key (with `config.unknown_keys: warn`, set for a
   rollback, both are logged at WARNING and skipped); variables without a double underscore
   (`$CHUNKCACHE_CONFIG`, `$CHUNKCACHE_HOME`) name no knob;
4. `chunkcache serve`'s flags `--model`, `--host`, `--port`, `--remote-url` (or `$CHUNKCACHE_REMOTE_URL`) and
   `--auto-chunks` (or `$CHUNKCACHE_AUTO_CHUNKS=1`);
5. the request: a chunk hint's or a chat `chunkcache` object's `selector`, `ratio`, `max_kl`, `namespace` and `exact`
   ([request-contract.md](request-contract.md)).

Every process of a server (`chunkcache serve`, SGLang's scheduler, a server started by SGLang's own command) loads the
file and then the variables, so all of them run on the same settings. A bad value, in the file or in a variable,
stops the server before it serves, naming the key (and the variable) and the reason.

Byte sizes (type `bytes`) are an int, or a number and a unit in any case: `4096`, `2GiB`, `512 MiB`, `1.5GB`,
`300MB`. The units: {", ".join(f"`{unit}`" for unit in BYTE_UNITS)}; kB, MB, GB and TB are powers of 1000, KiB, MiB,
GiB and TiB of 1024.
"""


def reference() -> str:
    """The text of docs/configuration.md."""
    parts = [INTRO]
    for path, cls, knobs in sections():
        instance = cls()
        parts.append(f"\n## `{'.'.join(path)}`\n\n{' '.join(cls.__doc__.split())}\n\n"
                     "| key | type | default | doc | environment variable |\n|---|---|---|---|---|\n")
        for f in knobs:
            cells = (f"`{'.'.join((*path, f.name))}`", f.type.replace("Bytes", "bytes").replace(" | None", " or null"),
                     f"`{_shown(getattr(instance, f.name), f.type)}`", f.metadata[DOC],
                     f"`{env_name((*path, f.name))}`")
            parts.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |\n")
    return "".join(parts)


def format_bytes(n: int) -> str:
    """`n` in the largest IEC unit that divides it, as a config may write it: 2147483648 -> "2GiB", 1000 -> "1000"."""
    for unit, size in sorted(BYTE_UNITS.items(), key=lambda item: -item[1]):
        if "i" in unit and n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _shown(value: Any, annotation: str) -> str:
    """A default as a YAML file writes it."""
    if annotation == "Bytes":
        return format_bytes(value)
    return value if isinstance(value, str) else json.dumps(value)


if __name__ == "__main__":
    print(reference(), end="")
