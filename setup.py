"""Builds the private C core, tpcomm._native (no PyTorch C++ extension)."""

from glob import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tpcomm._native",
            # one file per concern; src/tpcomm/_native/tpcomm.h is the map
            sorted(glob("src/tpcomm/_native/*.c")),
            depends=sorted(glob("src/tpcomm/_native/*.h")),
            extra_compile_args=[
                "-std=gnu11",
                "-O3",
                # IEEE results must not depend on the ISA clone: no contraction,
                # no reassociation (fixed summation order is a contract).
                "-ffp-contract=off",
                "-fno-fast-math",
                "-Wall",
                "-Wextra",
                "-Wno-missing-field-initializers",
                # the files share their functions through tpcomm.h; outside the
                # module only PyInit__native is seen (PyMODINIT_FUNC exports it)
                "-fvisibility=hidden",
            ],
        )
    ]
)
