"""The sgl_kernel stand-in: used only when the real module cannot load, and any call into it fails loudly."""

import subprocess
import sys
import textwrap

import pytest


def run(code: str, path) -> str:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=path, capture_output=True, text=True,
                          check=True).stdout


@pytest.fixture
def packages(tmp_path):
    good = tmp_path / "goodkern"
    good.mkdir()
    (good / "__init__.py").write_text("VALUE = 42\ndef op(x):\n    return x + 1\n")
    bad = tmp_path / "badkern"
    bad.mkdir()
    (bad / "__init__.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    (bad / "pure.py").write_text("CONST = 'pure python'\n")
    (bad / "needs_ops.py").write_text("from badkern import compiled_op\nraise OSError('needs the .so')\n")
    return tmp_path


def test_real_module_is_used_untouched_when_it_loads(packages):
    out = run("""
        import sys
        from sglang_patch.kernel_guard import SglKernelFinder, is_stand_in
        sys.meta_path.insert(0, SglKernelFinder("goodkern"))
        import goodkern
        print(is_stand_in(goodkern), goodkern.VALUE, goodkern.op(1))
    """, packages)
    assert out.split() == ["False", "42", "2"]


def test_stand_in_imports_and_calls_raise_naming_the_op(packages):
    out = run("""
        import sys
        from sglang_patch.kernel_guard import SglKernelFinder, MissingKernelOp, is_stand_in
        sys.meta_path.insert(0, SglKernelFinder("badkern"))
        from badkern import fused_add_rmsnorm_cpu
        from badkern.pure import CONST
        from badkern.needs_ops import something
        import badkern
        print(is_stand_in(badkern), CONST == 'pure python')
        for fn in (fused_add_rmsnorm_cpu, something):
            try:
                fn(1)
            except MissingKernelOp as e:
                print('raised', 'libcuda.so.1' in str(e), str(e).split(' was called')[0])
    """, packages)
    lines = out.splitlines()
    assert lines[0] == "True True"
    assert lines[1] == "raised True badkern.fused_add_rmsnorm_cpu"
    assert lines[2] == "raised True badkern.needs_ops.something"


def test_pth_hook_installs_guard_in_every_interpreter():
    out = subprocess.run([sys.executable, "-c", "import sys; from sglang_patch.kernel_guard import SglKernelFinder;"
                          "print(any(isinstance(f, SglKernelFinder) for f in sys.meta_path))"],
                         capture_output=True, text=True, check=True, cwd="/").stdout
    assert out.strip() == "True"
