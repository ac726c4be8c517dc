"""Maps the repository folders onto the ``trellm`` import names (see DESIGN.md).

pyproject.toml holds all metadata; this file only lists packages, because the folder-to-import
mapping must include every sub-package (new plugin folders are picked up automatically).
"""
from setuptools import find_packages, setup

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

setup(packages=packages, package_dir=package_dir)
