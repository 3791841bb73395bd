"""Stand-in for `sgl_kernel` on hosts where its CUDA build cannot load (no libcuda.so.1).

SGLang imports a few `*_cpu` names from `sgl_kernel` at module level even in CPU mode, and none of them is called
on the Llama path without AMX. This module installs a meta-path finder that, on the first `import sgl_kernel`, tries
the real package; only if that fails does it serve a stand-in whose attributes raise a clear error when *called*.
A host where the real module loads gets it untouched. The finder must be in place before sglang is imported in every
process (the scheduler is a spawned subprocess), so the package ships a .pth file that calls `install()` at every
interpreter start (setup.py puts it at the top of the wheel, editable or not).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from pathlib import Path

NAME = "sgl_kernel"
log = logging.getLogger(__name__)


class MissingKernelOp(RuntimeError):
    pass


class _StandIn(types.ModuleType):
    """Importable `sgl_kernel` (and any submodule) whose functions raise MissingKernelOp when called."""

    def __init__(self, name: str, reason: str):
        super().__init__(name)
        self.__path__ = []  # a package, so `from sgl_kernel.x import y` resolves through the finder
        self.__chunkcache_stand_in__ = reason

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        reason = self.__chunkcache_stand_in__
        qualname = f"{self.__name__}.{attr}"

        def missing(*args, **kwargs):
            raise MissingKernelOp(
                f"{qualname} was called, but sgl_kernel could not be loaded on this host ({reason}); "
                "chunkcache installed a stand-in so SGLang can run its CPU torch-native path. "
                "This op has no CPU fallback here: use a host with a GPU, or an SGLang option that avoids it."
            )

        missing.__name__ = missing.__qualname__ = attr
        return missing


class _Loader(importlib.abc.Loader):
    def __init__(self, module: types.ModuleType):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        pass


class _RealOrStandIn(importlib.abc.Loader):
    """Runs a real submodule of the unloadable package (pure-Python ones such as `scalar_type` work); if it fails
    because it needs the compiled ops, the stand-in takes its place."""

    def __init__(self, real: importlib.machinery.ModuleSpec, reason: str):
        self.real, self.reason = real, reason

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        try:
            self.real.loader.exec_module(module)
        except (ImportError, OSError, AttributeError) as exc:
            log.debug("sgl_kernel submodule %s replaced by the stand-in (%s)", module.__name__, exc)
            stand_in = _StandIn(module.__name__, self.reason)
            module.__dict__.clear()
            module.__dict__.update(stand_in.__dict__)
            module.__class__ = _StandIn


class SglKernelFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str = NAME):
        self.name = name
        self.reason: str | None = None  # set once the real module has failed to load
        self.real_dir: str | None = None  # where the real package lives, for its pure-Python submodules

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name and not fullname.startswith(self.name + "."):
            return None
        if self.reason is None:
            if fullname != self.name:
                return None  # the real package is loaded; its submodules import normally
            module = self._try_real()
            if module is not None:
                return importlib.machinery.ModuleSpec(self.name, _Loader(module), is_package=True)
        if fullname != self.name and self.real_dir:
            parent_dir = str(Path(self.real_dir, *fullname.split(".")[1:-1]))
            real = importlib.machinery.PathFinder.find_spec(fullname, [parent_dir])
            if real is not None:
                return importlib.machinery.ModuleSpec(
                    fullname, _RealOrStandIn(real, self.reason), origin=real.origin,
                    is_package=real.submodule_search_locations is not None,
                )
        return importlib.machinery.ModuleSpec(fullname, _Loader(_StandIn(fullname, self.reason)), is_package=True)

    def _try_real(self) -> types.ModuleType | None:
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(self.name)
            if spec is not None and spec.submodule_search_locations:
                self.real_dir = list(spec.submodule_search_locations)[0]
            return importlib.import_module(self.name)
        except (ImportError, OSError) as exc:
            for mod in [m for m in sys.modules if m == self.name or m.startswith(self.name + ".")]:
                del sys.modules[mod]
            # the real error is often buried in a long diagnostic message: keep its first "...Error: ..." line
            lines = [ln.strip(" -") for ln in str(exc).splitlines() if "Error:" in ln] or [str(exc)]
            self.reason = f"{type(exc).__name__}: {lines[0]}"
            log.warning("%s cannot load (%s); using chunkcache's stand-in (ops raise if called)", self.name, self.reason)
            return None
        finally:
            sys.meta_path.insert(0, self)


def install() -> None:
    """Idempotent: put the finder first on sys.meta_path."""
    if not any(isinstance(f, SglKernelFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, SglKernelFinder())


def is_stand_in(module: types.ModuleType) -> bool:
    return isinstance(module, _StandIn)
