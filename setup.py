"""Build the Cython kernels in ext/ as modules of the hpcdl._ext package."""

from __future__ import annotations

from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

#: flags of one module: fused.pyx must compute what NumPy computes, bit for bit, so no multiply
#: and add may become one FMA (GCC contracts by default when the target has FMA: -march=native);
#: errno is not set by its square roots (only then can they vectorise; the results are the same)
MODULE_FLAGS = {"fused": ["-ffp-contract=off", "-fno-math-errno"]}

extensions = [
    Extension(
        f"hpcdl._ext.{pyx.stem}",
        [str(pyx)],
        include_dirs=[numpy.get_include(), "ext"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3", *MODULE_FLAGS.get(pyx.stem, [])],
        # rebuild when a header or a shared declaration file changes
        depends=[str(h) for h in sorted([*Path("ext").glob("*.h"), *Path("ext").glob("*.pxd")])],
    )
    for pyx in sorted(Path("ext").glob("*.pyx"))
]

setup(
    ext_modules=cythonize(extensions, language_level=3, include_path=["ext"]),
    # the bundled digits, found by hpcdl.data.digits in <prefix>/share/hpcdl when not run from a checkout
    data_files=[("share/hpcdl", ["data/digits.npz"])],
)
