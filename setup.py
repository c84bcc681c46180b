"""Build the native rANS coder (csrc/) as a plain shared library shipped inside cachegen_core.

It is loaded with ctypes (cachegen_core/coders/native_lib.py), never imported, so it needs
no Python or torch headers and builds in seconds. Metadata lives in pyproject.toml.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildSharedLibrary(build_ext):
    """Compile the C++ core without Python's module conventions (no PyInit symbol is needed)."""

    def get_export_symbols(self, ext):  # noqa: D102
        return []


setup(
    ext_modules=[
        Extension(
            "cachegen_core._native",
            sources=["csrc/rans_cpu.cpp", "csrc/kv_fused.cpp", "csrc/kv_encode.cpp"],
            depends=["csrc/rans_core.h", "csrc/rans_cpu_impl.h", "csrc/kv_core.h", "csrc/torch_sum.h"],
            include_dirs=["csrc"],
            language="c++",
            # no fused multiply-add: the native KV decoder and encoder round exactly as the torch path
            extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", "-ffp-contract=off"],
            extra_link_args=["-pthread"],
            optional=True,  # without a compiler the package still installs; the reference coder is used
        )
    ],
    cmdclass={"build_ext": BuildSharedLibrary},
)
