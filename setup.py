"""Package discovery for setuptools: the one rule that maps the source folders to import names.

``bridge/`` installs as ``ckptbridge`` and ``adapters/`` as ``ckptbridge.adapters``; every folder
below them that has an ``__init__.py`` is a subpackage, found here, never listed by hand (a
hand-written list once shipped a wheel without ``ckptbridge._rules``). ``py.typed`` ships with the
top package. Everything else (metadata, dependencies, entry points) is in ``pyproject.toml``;
``tests/test_wheel.py`` builds the sdist and the wheel and installs the wheel in fresh venvs.
"""

from setuptools import find_packages, setup

ROOTS = {"bridge": "ckptbridge", "adapters": "ckptbridge.adapters"}


def packages() -> list[str]:
    out = []
    for folder, name in ROOTS.items():
        out.append(name)
        out += [f"{name}.{sub}" for sub in find_packages(folder)]
    return out


setup(packages=packages(), package_dir={name: folder for folder, name in ROOTS.items()},
      package_data={"ckptbridge": ["py.typed"]})
