"""Builds the `ferry` Python package through CMake (pyproject.toml has the metadata).

The extension ferry._ferry and the `ferry` command are CMake targets; this file runs
CMake (Release, no tests, no benchmarks) and copies into the package:
    ferry/_ferry.<abi>.so             the extension (ferry's libraries linked statically)
    ferry/bin/ferry[, ferry-mpi-bcast] the command (`python -m ferry`, console script)
    ferry/share/ferry/configs/*.json  the model configs the commands default to
Environment:
    FERRY_BUILD_DIR   an existing or new CMake build directory to use (e.g. the one
                      `cmake --install` and cpack use), instead of one under build/
    FERRY_CMAKE_ARGS  extra arguments for the first configure (space separated)
    FERRY_JOBS        parallel build jobs (default: all cores)
"""
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def project_version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        m = re.search(r"project\(\s*ferry\s+VERSION\s+([0-9.]+)", f.read())
    if not m:
        raise RuntimeError("setup.py: no project(ferry VERSION x.y.z) in CMakeLists.txt")
    return m.group(1)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.path.abspath(os.environ.get("FERRY_BUILD_DIR") or os.path.join(ROOT, "build", "python-package"))
        if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            args = ["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release", "-DFERRY_TESTS=OFF",
                    "-DFERRY_BENCH=OFF", "-DFERRY_PYTHON=ON", f"-DPython3_EXECUTABLE={sys.executable}"]
            if shutil.which("ninja"):
                args += ["-G", "Ninja"]
            args += shlex.split(os.environ.get("FERRY_CMAKE_ARGS", ""))
            subprocess.check_call(args)
        jobs = os.environ.get("FERRY_JOBS") or str(os.cpu_count() or 1)
        subprocess.check_call(["cmake", "--build", build_dir, "-j", jobs, "--target", "ferry_python", "ferry"])

        built = glob.glob(os.path.join(build_dir, "python", "ferry", "_ferry*.so"))
        if len(built) != 1:
            raise RuntimeError(f"setup.py: expected one _ferry*.so in {build_dir}/python/ferry, found {built}")
        target = self.get_ext_fullpath(ext.name)
        pkg = os.path.dirname(target)
        os.makedirs(pkg, exist_ok=True)
        shutil.copy2(built[0], target)

        bindir = os.path.join(pkg, "bin")
        os.makedirs(bindir, exist_ok=True)
        for exe in ("ferry", "ferry-mpi-bcast"):
            path = os.path.join(build_dir, "src", "cli", exe)
            if os.path.exists(path):
                shutil.copy2(path, os.path.join(bindir, exe))
        configs = os.path.join(pkg, "share", "ferry", "configs")
        os.makedirs(configs, exist_ok=True)
        for cfg in glob.glob(os.path.join(ROOT, "configs", "*.json")):
            shutil.copy2(cfg, configs)


setup(
    version=project_version(),
    ext_modules=[Extension("ferry._ferry", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
    # setuptools' own staging under build/setuptools, beside (not inside) CMake's builds.
    options={"build": {"build_base": os.path.join("build", "setuptools")}},
)
