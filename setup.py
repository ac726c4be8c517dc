"""Maps the repository folders onto the ``trellm`` import names, and tags wheels that carry kernels.

pyproject.toml holds all metadata; this file lists packages, because the folder-to-import mapping
must include every sub-package (new plugin folders are picked up automatically). A wheel built after
``trellm build-kernels --arch ... --into kernels_cuda/prebuilt`` holds the CUDA kernel library: it is
tagged for this platform (``py3-none-linux_x86_64``: the library uses no Python or torch ABI).
"""
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.bdist_wheel import bdist_wheel

PREBUILT = Path(__file__).resolve().parent / "kernels_cuda" / "prebuilt"


class PlatformWheel(bdist_wheel):
    """A pure-Python wheel unless the prebuilt kernel library is there."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = not any(PREBUILT.glob("*.so"))

    def get_tag(self):
        python, abi, platform = super().get_tag()
        return (python, abi, platform) if self.root_is_pure else ("py3", "none", platform)


ROOTS = {
    "trellm": "core",
    "trellm.plugins": "plugins",
    "trellm.kernels_cuda": "kernels_cuda",
    "trellm.sdk": "sdk",
    "trellm.server": "server",
}

packages, package_dir = [], {}
for name, folder in ROOTS.items():
    package_dir[name] = folder
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir, cmdclass={"bdist_wheel": PlatformWheel})
