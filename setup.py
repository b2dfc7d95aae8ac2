"""The one compiled part of kvmem: ``kvmem._stream`` (streaming copies of large host buffers).

Everything else is in pyproject.toml. The extension is optional: where it cannot be built
(no C compiler), kvmem installs without it and copies through torch instead.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvmem._stream", ["kvmem/_stream.c"], optional=True)])
