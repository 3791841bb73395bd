"""Everything but one file is declared in pyproject.toml. That file is the kernel guard's .pth, at the top of the
wheel: site-packages runs it at every interpreter start, so the guard is in place before SGLang is imported in any
process of the environment, spawned schedulers included (sglang_patch/kernel_guard.py says why it must be).
Installing the wheel installs it, and uninstalling removes it (it is in the wheel's RECORD)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "chunkcache_sgl_kernel_guard.pth"
PTH_LINE = "import sglang_patch.kernel_guard as _g; _g.install()\n"


class BuildPyWithGuard(build_py):
    def run(self) -> None:
        super().run()
        # An editable wheel takes only import paths from build_lib (the packages stay in the source tree); what goes
        # into it as a file is what build commands write to the install directory, which editable_wheel sets to the
        # wheel's root.
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        Path(root, PTH_NAME).write_text(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib, PTH_NAME))]


setup(cmdclass={"build_py": BuildPyWithGuard})
