"""Build the optional C row checker; rr falls back to numpy when it cannot compile."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "rr_client.core._rowcheck_c",
            sources=["rr_client/core/_rowcheck.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
