"""The import graph the packages promise, read from the source with `ast`, nothing imported:
`chunkcache` (the core) never imports SGLang, the glue or the harness; `sglang_patch` (the glue) never imports
`chunkbench` (the harness), which reaches the CLI through the `chunkcache.commands` entry points instead; no package
has a cycle among its modules. Inside the harness, a folder per question (`chunkbench/serving`, `quality`, `studies`,
`kernels`) imports only the folders below it and the modules the folders share at chunkbench's top level, which import
no folder, so no two folders import each other. Inside the glue, a folder per process and seam (`sglang_patch/http`,
`scheduler`, `forward`, `decode`, `serve`) imports only the folders listed for it below; at sglang_patch's top level only
the plugin, the entry point, imports the folders.

Every import statement counts, the ones inside functions too: a function-level import only defers the same
dependency to the first call, and a cycle through it is still a cycle. Importing `a.b.c` also runs `a/__init__.py`
and `a/b/__init__.py`, so those are edges too, except for the importer's own packages (a module inside
`chunkcache.select` needs `chunkcache/select/__init__.py` run, or at least started, whatever it imports)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("chunkcache", "sglang_patch", "chunkbench")


def _modules() -> dict[str, Path]:
    """Every module of the three packages by dotted name (a package by its own name: its __init__.py)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imported(module: str, path: Path) -> set[str]:
    """Absolute names of what `module` imports, with the packages importing each one runs first."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module
            names.add(base)
            # `from pkg import mod` imports the submodule pkg.mod when there is one
            names.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1 + is_package)}
    with_parents = set()
    for name in names:
        parts = name.split(".")
        with_parents.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return with_parents - own - {module}


GRAPH = {module: _imported(module, path) for module, path in MODULES.items()}


def _offenders(importer: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{module} imports {name}" for module, names in GRAPH.items() if module.split(".")[0] == importer
                  for name in names if name.split(".")[0] in forbidden)


def test_the_glue_never_imports_the_harness():
    assert _offenders("sglang_patch", ("chunkbench",)) == []


def test_the_core_never_imports_sglang_the_glue_or_the_harness():
    assert _offenders("chunkcache", ("sglang", "sgl_kernel", "sglang_patch", "chunkbench")) == []


def _cycle(nodes: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as [a, b, ..., a], or [] when it has none (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(nodes):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(nodes[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(nodes[nxt])))
    return []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_a_package(package):
    """Between the packages the arrows above already rule one out."""
    inside = {m: {n for n in names if n.split(".")[0] == package and n in GRAPH}
              for m, names in GRAPH.items() if m.split(".")[0] == package}
    cycle = _cycle(inside)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"a"}}, ["a", "a"]),
])
def test_cycle_finder(graph, cycle):
    assert _cycle(graph) == cycle


def test_graph_reads_relative_and_function_level_imports():
    """The parser itself: a cycle test over a graph with no edges would pass whatever the code imports."""
    assert "chunkcache.select.base" in GRAPH["chunkcache.select.cacheblend"]  # from .base import ...
    assert "chunkcache.models" in GRAPH["chunkcache.draft"]  # inside a function
    assert "chunkcache.select" in GRAPH["chunkcache.blend.pipeline"]  # a package's __init__ runs first
    assert "chunkcache.select" not in GRAPH["chunkcache.select.base"]  # not its own package
    assert "chunkbench.serving.http_client" in GRAPH["chunkbench.quality.server_path"]  # from ..serving.http_client
    assert "chunkbench.quality.fidelity_measures" in GRAPH["chunkbench.studies.select_fidelity"]  # submodule, 2 dots up
    assert "chunkbench.serving" in GRAPH["chunkbench.studies.segment_coverage"]  # the folder's __init__ runs first
    assert "sglang_patch.forward.forward_pass" in GRAPH["sglang_patch.scheduler.blend"]  # from ..forward.forward_pass
    assert "sglang_patch.serve.launcher" in GRAPH["sglang_patch.decode.specache"]  # two dots up, inside a function
    assert "sglang_patch.http.chat" in GRAPH["sglang_patch.plugin"]  # from .http import chat: a folder's submodule


# chunkbench's folders, each with the folders it may import: those below it. quality's server path drives a live
# server through serving's client; studies measure on quality's reference path (and segment_coverage pastes
# auto_bench's templates); kernels run alone, from a plain checkout on a GPU machine.
HARNESS_FOLDERS = {
    "serving": set(),
    "quality": {"serving"},
    "studies": {"serving", "quality"},
    "kernels": set(),
}
# chunkbench's modules outside the folders: the commands' entry point, and what the folders share
HARNESS_ENTRY = "chunkbench.commands"
HARNESS_SHARED = {"chunkbench.workloads", "chunkbench.synthetic", "chunkbench.scoring", "chunkbench.intervals"}

# sglang_patch's folders, each with the folders it may import, in the order plugin.hooks() meets them: the HTTP server
# process refuses the radix partition the scheduler reserves for hinted requests (http.hint_validation reads
# scheduler.request_hint); the scheduler's blend and automatic detection run forward's passes of SGLang's model; decode
# is the decode step, which nothing else imports; and every process reads the server's settings from serve (launcher),
# which imports no folder, nor does forward. So: http -> scheduler -> forward, and http, scheduler, decode -> serve.
GLUE_FOLDERS = {
    "http": {"scheduler", "serve"},
    "scheduler": {"forward", "serve"},
    "forward": set(),
    "decode": {"serve"},
    "serve": set(),
}
# sglang_patch's modules outside the folders: the plugin (the entry point: its hooks() table imports every folder), the
# frontend programs' primitives and the kernel guard (run from a .pth at every interpreter start), which import none
GLUE_ENTRY = "sglang_patch.plugin"
GLUE_TOP = {"sglang_patch.lang", "sglang_patch.kernel_guard"}

# per package: its folders, its entry point (may import every folder; no folder imports it), and the modules at its top
# level that the folders may import and that import no folder
FOLDERS = {"chunkbench": HARNESS_FOLDERS, "sglang_patch": GLUE_FOLDERS}
ENTRY = {"chunkbench": HARNESS_ENTRY, "sglang_patch": GLUE_ENTRY}
TOP = {"chunkbench": HARNESS_SHARED, "sglang_patch": GLUE_TOP}


def _folder(name: str, package: str) -> str | None:
    """The folder of `package` that `name` is in or names (chunkbench.serving.ab -> serving), None outside them (and
    for any name outside `package`)."""
    parts = name.split(".")
    return parts[1] if parts[0] == package and len(parts) > 1 and parts[1] in FOLDERS[package] else None


@pytest.mark.parametrize("package", FOLDERS)
def test_every_module_is_in_a_folder_or_listed_at_the_top(package):
    """A new module is placed on purpose: in a folder listed above, or added to the package's top-level modules."""
    top = {package, ENTRY[package]} | TOP[package]
    assert sorted(m for m in GRAPH if m.split(".")[0] == package and m not in top and _folder(m, package) is None) == []
    on_disk = {p.parent.name for p in (ROOT / package).glob("*/__init__.py")}
    assert on_disk == set(FOLDERS[package])
    assert TOP[package] | {ENTRY[package]} <= set(GRAPH)


@pytest.mark.parametrize("package", FOLDERS)
def test_the_top_level_modules_import_no_folder(package):
    """The package itself and its top-level modules but the entry point: whatever imports them runs no folder."""
    assert sorted(f"{module} imports {name}" for module in {package} | TOP[package] for name in GRAPH[module]
                  if _folder(name, package) is not None or name == ENTRY[package]) == []


@pytest.mark.parametrize("package", FOLDERS)
def test_a_folder_imports_only_the_folders_listed_for_it(package):
    offenders = []
    for module, names in GRAPH.items():
        own = _folder(module, package)
        if own is not None:
            allowed = {None, own, *FOLDERS[package][own]}
            offenders += [f"{module} imports {name}" for name in sorted(names)
                          if name == ENTRY[package] or _folder(name, package) not in allowed]
    assert offenders == []


@pytest.mark.parametrize("package", FOLDERS)
def test_no_import_cycle_between_folders(package):
    """Whatever the tables above allow: two folders that import each other are one folder."""
    folders: dict[str, set[str]] = {f: set() for f in FOLDERS[package]}
    for module, names in GRAPH.items():
        own = _folder(module, package)
        if own is not None:
            folders[own] |= {_folder(n, package) for n in names if _folder(n, package) not in {None, own}}
    cycle = _cycle(folders)
    assert not cycle, f"import cycle between {package}'s folders: " + " -> ".join(cycle)
