"""The README stays short and the docs site stays whole: every page is in mkdocs.yml's nav and every nav entry exists.
(scripts/test.sh builds the site with `mkdocs build --strict`, which also fails on broken links.)"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 250


def _nav_files(entries) -> list[str]:
    files = []
    for entry in entries:
        if isinstance(entry, str):
            files.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                files.extend([value] if isinstance(value, str) else _nav_files(value))
    return files


def _config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/ (at most " \
                                           f"{README_MAX_LINES})"


def test_readme_names_the_test_command():
    assert any(line.startswith("./scripts/test.sh") for line in (ROOT / "README.md").read_text().splitlines())
    assert re.search(r'mkdocs"? build --strict', (ROOT / "scripts" / "test.sh").read_text()), \
        "scripts/test.sh must build the docs site with --strict"


def test_every_nav_entry_exists():
    nav = _nav_files(_config()["nav"])
    assert nav and len(nav) == len(set(nav)), "mkdocs.yml's nav lists a page twice"
    missing = [name for name in nav if not (DOCS / name).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages that docs/ lacks: {missing}"


def test_every_page_is_in_the_nav():
    nav = set(_nav_files(_config()["nav"]))
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    orphans = sorted(pages - nav)
    assert not orphans, f"docs/ pages missing from mkdocs.yml's nav: {orphans}"
    assert {"index.md", "architecture.md"} <= nav
