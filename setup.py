"""Packaging beyond pyproject.toml: the model-family specs and templates live at the repository root (``specs/``,
``templates/``) and ship inside the package as ``bloombee/models/specs`` and ``bloombee/models/templates``."""

from setuptools import find_namespace_packages, setup

DATA_PACKAGES = {"bloombee.models.specs": "specs", "bloombee.models.templates": "templates"}

setup(packages=find_namespace_packages(include=["bloombee*"]) + list(DATA_PACKAGES), package_dir=DATA_PACKAGES)
