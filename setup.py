"""Everything about the package is in pyproject.toml; this file only compiles brisk's C++
kernels (brisk/kernels/*.cpp, one plain C library loaded with ctypes) into the
wheel, so `pip install .` / `pipx install .` from a checkout ships them built. An editable
install leaves that to `make` (python -m brisk.kernels)."""

import importlib.util
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent


def _kernel_builder():
    # loaded from its file: importing the brisk package would need torch, absent from pip's build env
    spec = importlib.util.spec_from_file_location("_brisk_kernel_build", HERE / "brisk" / "kernels" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        out = Path(self.build_lib) / "brisk" / "kernels" / "_kernels.so"
        try:
            _kernel_builder().build(out)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            self.warn(f"brisk's C++ kernels were not compiled ({detail.strip()[:200]}); brisk builds them on first "
                      "use if a compiler is there then, else runs quantized layers on the slower torch path")


class PlatformDistribution(Distribution):
    """The wheel holds a compiled library: tag it for this platform, not py3-none-any."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=PlatformDistribution)
