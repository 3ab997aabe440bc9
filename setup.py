"""Builds the Cython kernels in armdb/_core (bounds and wraparound checks only with ARMDB_CYTHON_DEBUG=1)."""

import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("ARMDB_CYTHON_DEBUG") == "1"

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": not DEBUG,
    "embedsignature": True,
}

extensions = [
    Extension(
        f"armdb._core.{name}",
        [f"armdb/_core/{name}.pyx"],
        include_dirs=[np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3"] if not DEBUG else ["-O0", "-g"],
    )
    for name in ("fixed", "qindex", "qrow", "qshard", "groupsync", "atomicfile", "plain", "plainpack", "bodycache",
                 "locks")
    if os.path.exists(f"armdb/_core/{name}.pyx")
]

setup(ext_modules=cythonize(extensions, compiler_directives=directives))
