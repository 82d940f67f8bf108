"""Builds pxrt's Cython extensions. Metadata lives in pyproject.toml.

PXRT_DEBUG=1 builds with bounds checks back on, line tracing and an annotated HTML
report per module (``make debug``).
"""

import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("PXRT_DEBUG") == "1"

directives = {"language_level": 3, "embedsignature": True}
macros = [("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION")]
if DEBUG:
    directives.update(boundscheck=True, wraparound=True, linetrace=True)
    macros.append(("CYTHON_TRACE_NOGIL", "1"))

extensions = [
    Extension(
        f"pxrt.{name}",
        [f"pxrt/{name}.pyx"],
        include_dirs=[np.get_include()],
        define_macros=macros,
        extra_compile_args=["-O0", "-g"] if DEBUG else ["-O3"],
    )
    for name in ("_keys", "_handlers")
]

setup(ext_modules=cythonize(extensions, compiler_directives=directives, annotate=DEBUG))
