"""Every reference to a docs page (``docs/<page>.md`` and ``docs/<page>.md#<anchor>``) in the
code, tests, README and docs points to a page that exists and a heading it has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REFERENCE = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+))?")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in page.read_text().splitlines()
            if line.startswith("#")}


def _sources() -> list[Path]:
    found = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for folder in ("dpcfl_flwr", "tests", "bench", "examples"):
        found += sorted(p for p in (REPO / folder).rglob("*")
                        if p.suffix in (".py", ".toml", ".md") and p.is_file())
    return found


def test_every_docs_reference_resolves():
    broken, seen = [], 0
    for source in _sources():
        for number, line in enumerate(source.read_text(errors="replace").splitlines(), 1):
            for page, anchor in REFERENCE.findall(line):
                seen += 1
                target = REPO / "docs" / page
                where = f"{source.relative_to(REPO)}:{number}"
                if not target.is_file():
                    broken.append(f"{where}: no docs/{page}")
                elif anchor and anchor not in _anchors(target):
                    broken.append(f"{where}: docs/{page} has no heading #{anchor}")
    assert seen > 20  # the code does cite the docs
    assert not broken, "\n".join(broken)


def _layout_sections() -> dict[str, str]:
    """docs/README.md's package map, by entry: a top-level module (``cli.py``) or a package
    (``silo/``) with the text that describes it."""
    text = (REPO / "docs" / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    sections: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        entry = re.match(r"^  (\S+)", line)
        if entry:
            current = entry.group(1)
            sections[current] = ""
        if current is not None:
            sections[current] += line + "\n"
    return sections


def test_the_package_map_names_every_module():
    """A module missing from docs/README.md's layout is a room a newcomer cannot find."""
    sections = _layout_sections()
    package = REPO / "dpcfl_flwr"
    missing = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if path.name == "__init__.py":
            continue
        if len(relative.parts) == 1:
            if path.name not in sections:
                missing.append(str(relative))
        elif path.name not in sections.get(f"{relative.parts[0]}/", ""):
            missing.append(str(relative))
    assert missing == [], f"add these to the layout in docs/README.md: {missing}"


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


@pytest.mark.parametrize("page", ["README.md", "docs/adding-a-method.md"])
def test_the_worked_method_example_imports_as_written(page, monkeypatch):
    """The 'add a method' example, saved in dpcfl_flwr/methods/ as the page says, imports
    and defines a Method (registration itself is left out, so no test sees a 'fixed')."""
    import types

    from dpcfl_flwr.config import registry
    from dpcfl_flwr.methods.base import Method

    monkeypatch.setattr(registry, "register", lambda cls: cls)
    code = next(block for block in _python_blocks(REPO / page) if "class Fixed(" in block)
    module = types.ModuleType("dpcfl_flwr.methods.fixed")
    module.__package__ = "dpcfl_flwr.methods"
    exec(compile(code, f"{page}:fixed", "exec"), module.__dict__)  # noqa: S102 - our own docs
    assert issubclass(module.Fixed, Method) and module.Fixed.name == "fixed"
