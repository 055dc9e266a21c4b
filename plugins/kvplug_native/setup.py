"""The C extension of kvplug-native; everything else is in pyproject.toml."""

from __future__ import annotations

import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPENMP_FLAG = "-fopenmp"


class BuildWithOpenMP(build_ext):
    """Builds with OpenMP where the compiler has it (gcc; Apple's clang has not): copies then run on the
    caller's OpenMP team, the one torch's ops use. Without it the extension still builds, one thread per call."""

    def build_extensions(self) -> None:
        if self.compiler.compiler_type == "unix" and self._compiles_with(OPENMP_FLAG):
            for extension in self.extensions:
                extension.extra_compile_args.append(OPENMP_FLAG)
                extension.extra_link_args.append(OPENMP_FLAG)
        super().build_extensions()

    def _compiles_with(self, flag: str) -> bool:
        with tempfile.TemporaryDirectory() as folder:
            source = Path(folder, "probe.c")
            source.write_text("int main(void) {\n#pragma omp parallel\n{}\nreturn 0;\n}\n")
            try:
                objects = self.compiler.compile([str(source)], output_dir=folder, extra_postargs=[flag])
                self.compiler.link_executable(objects, "probe", output_dir=folder, extra_postargs=[flag])
            except Exception:  # setuptools raises CompileError / LinkError; any failure means no OpenMP
                return False
        return True


setup(
    ext_modules=[
        Extension(
            "kvplug_native._copy",
            sources=["kvplug_native/_copy.c"],
            # One build for every CPython from 3.10 on (abi3 wheel).
            define_macros=[("Py_LIMITED_API", "0x030A0000")],
            py_limited_api=True,
            extra_compile_args=["-O2"],
        )
    ],
    cmdclass={"build_ext": BuildWithOpenMP},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
