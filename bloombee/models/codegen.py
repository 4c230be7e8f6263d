"""Render every ``specs/<family>.yaml`` through ``templates/*.py.j2`` into a ``<family>/`` package.

Specs and templates live at the repository root (``specs/``, ``templates/``). An installed wheel carries them inside
the package as ``bloombee/models/specs`` and ``bloombee/models/templates`` (see ``setup.py``), so the defaults work from
an installed package as from a checkout. The generated packages land in ``bloombee/models``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jinja2

from bloombee.models.spec import FamilySpec, load_spec

logger = logging.getLogger(__name__)

MODELS_DIR = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    """``bloombee/models/<name>`` in an installed wheel; ``<repository>/<name>`` in a checkout (editable or not)."""
    installed = MODELS_DIR / name
    return installed if installed.is_dir() else MODELS_DIR.parents[1] / name


SPECS_DIR = _data_dir("specs")
TEMPLATES_DIR = _data_dir("templates")
GENERATED_FILES = ("config.py", "block.py", "model.py", "__init__.py")
LINE_WIDTH = 120


def wrap(items: list[str], indent: int, close: str, width: int = LINE_WIDTH) -> str:
    """``items`` joined by ", " and ended by ``close``, broken into lines of at most ``width`` columns
    (the first line is taken to start, and the others start, at column ``indent``)."""
    lines, line = [], []
    for item in items:
        if line and indent + len(", ".join(line + [item])) + max(len(close), 1) > width:
            lines.append(", ".join(line) + ",")
            line = []
        line.append(item)
    lines.append(", ".join(line) + close)
    return ("\n" + " " * indent).join(lines)


def py_dict(mapping: dict, indent: int) -> str:
    """The Python literal of ``mapping``, wrapped like ``wrap`` (``indent``: the column of its opening brace)."""
    return "{" + wrap([f"{key!r}: {value!r}" for key, value in mapping.items()], indent + 1, "}")


def _environment(templates_dir: Path) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    env.filters["py"] = repr
    env.filters["tuple"] = tuple
    env.filters["py_dict"] = py_dict
    env.filters["wrap"] = wrap
    return env


def class_prefix(family: str) -> str:
    """``"my_family"`` -> ``"MyFamily"``, the prefix of the family's class names."""
    return "".join(part[:1].upper() + part[1:] for part in family.split("_"))


def render_spec(spec: FamilySpec, spec_path: str, templates_dir: Path = TEMPLATES_DIR) -> dict[str, str]:
    """File name -> text of one family's generated package."""
    env = _environment(templates_dir)
    files = {}
    for name in GENERATED_FILES:
        template = f"{name}.j2"
        files[name] = env.get_template(template).render(
            spec=spec, family=spec.family, cls=class_prefix(spec.family), spec_path=spec_path, template=template)
    return files


def render_all(specs_dir: Path = SPECS_DIR, templates_dir: Path = TEMPLATES_DIR) -> dict[str, dict[str, str]]:
    """Validate every spec first, then render: family -> {file name -> text}."""
    paths = sorted(Path(specs_dir).glob("*.yaml"))
    if not paths:
        raise FileNotFoundError(f"no specs (*.yaml) in {specs_dir}")
    specs = [(path, load_spec(path)) for path in paths]  # all validated before anything is generated
    return {spec.family: render_spec(spec, f"specs/{path.name}", templates_dir) for path, spec in specs}


def write_all(rendered: dict[str, dict[str, str]], out_dir: Path = MODELS_DIR) -> list[Path]:
    """Write each family's package under ``out_dir``; return the files whose text changed."""
    written = []
    for family, files in rendered.items():
        folder = Path(out_dir) / family
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            path = folder / name
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
                written.append(path)
    logger.info("rendered %d families into %s, %d files changed", len(rendered), out_dir, len(written))
    return written


def drift(rendered: dict[str, dict[str, str]], out_dir: Path = MODELS_DIR) -> list[str]:
    """Generated files whose committed text differs from a fresh render (or that are missing)."""
    problems = []
    for family, files in rendered.items():
        for name, text in files.items():
            path = Path(out_dir) / family / name
            if not path.exists():
                problems.append(f"{path}: missing")
            elif path.read_text() != text:
                problems.append(f"{path}: differs from a fresh render of specs/{family}.yaml")
    return problems
