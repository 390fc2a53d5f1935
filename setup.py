"""The package list, found rather than listed (metadata and the rest: pyproject.toml).

The repository keeps ``torch_impl/`` and ``reference/`` at its top level; the distribution
installs them as ``moezero`` (the torch side), ``moezero.plan`` (``reference/plan``, the
shared pure plan) and ``moezero.reference`` (the JAX half, without its ``plan`` folder, which
is ``moezero.plan``). Every folder under them is a package here (``recipes/``, without an
``__init__.py``, holds package data: pyproject.toml), so a new subpackage ships without an
edit; ``tests/wheel/check_wheel.py`` holds the built wheel to the source tree.
"""

from setuptools import find_namespace_packages, setup

ROOTS = {"moezero": "torch_impl", "moezero.plan": "reference/plan",
         "moezero.reference": "reference", "moezero.docs": "docs"}  # docs: *.md package data


def packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        # a folder that is another root's (reference/plan) is that package, not a subpackage
        other = [f.removeprefix(folder + "/").replace("/", ".") for f in ROOTS.values()
                 if f.startswith(folder + "/")]
        subs = find_namespace_packages(folder, exclude=[*other, *(o + ".*" for o in other)])
        found += [name, *(f"{name}.{s}" for s in sorted(subs))]
    return found


setup(packages=packages(), package_dir=ROOTS)
