"""Builds pxrt's Cython extensions. Metadata lives in pyproject.toml.

Bounds and wraparound checks are off in the release build: the hot loops index only
lists they built or checked themselves (tests hold the Cython modules to their
pure-Python twins). PXRT_DEBUG=1 turns them back on everywhere, with line tracing and
an annotated HTML report per module (``make debug``); no module overrides that.
"""

import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("PXRT_DEBUG") == "1"

directives = {
    "language_level": 3,
    "embedsignature": True,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
}
macros = [("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION")]
if DEBUG:
    directives.update(linetrace=True)
    macros.append(("CYTHON_TRACE_NOGIL", "1"))

extensions = [
    Extension(
        name,
        [name.replace(".", "/") + ".pyx"],
        include_dirs=[np.get_include()],
        define_macros=macros,
        extra_compile_args=["-O0", "-g"] if DEBUG else ["-O3"],
    )
    for name in (
        "pxrt._keys",
        "pxrt._handlers",
        "pxrt._batch",
        "pxrt._slots",
        "serving.kserve._tensors",
        "serving.grpc._hpack",
        "serving.kserve._shmguard",
    )
]

# Both steps on every core: Cython's translation (nthreads) and the C compiles (build_ext's
# parallel), the longest part of installing pxrt.
JOBS = os.cpu_count() or 1
setup(
    ext_modules=cythonize(
        extensions, compiler_directives=directives, annotate=DEBUG, nthreads=JOBS
    ),
    options={"build_ext": {"parallel": JOBS}},
)
