"""Comments and docstrings cite documents of this repository: no ``DESIGN.md §N`` (a page
outside it), every ``docs/*.md`` or ``README.md`` cited exists, and a section named right
after it (``docs/model.md, "Router"``) starts one of its headings or bold list items."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("torch_impl", "reference", "benchmarks", "tests", "parity_tests")
CITATION = re.compile(r'\b((?:docs/)?[\w-]+\.md)(?:,? \(?"([^"\n]+)")?')
OUTSIDE = re.compile(r"(?<![/\w])DESIGN\.md")


def headings(doc: Path) -> list[str]:
    """The titles of ``doc``'s sections and list items (``## Router``, ``- **Router**``)."""
    return [line.lstrip("#- ").replace("**", "") for line in doc.read_text().splitlines()
            if line.startswith(("#", "- "))]


def bad_citations(root: Path = ROOT) -> list[str]:
    """``path:line: why`` of every citation that names no document (section) of ``root``."""
    found = []
    for path in sorted(p for top in SOURCES for p in (root / top).rglob("*.py")):
        if path == Path(__file__):
            continue
        name = path.relative_to(root).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{name}:{number}: cites DESIGN.md, which is not in the repository")
            for doc, section in CITATION.findall(line):
                target = root / doc
                if not (doc.startswith("docs/") or doc == "README.md"):
                    continue
                if not target.is_file():
                    found.append(f"{name}:{number}: {doc} does not exist")
                elif section and not any(h.startswith(section) for h in headings(target)):
                    found.append(f"{name}:{number}: {doc} has no section {section!r}")
    return found


def test_every_citation_names_a_document_of_the_repository():
    assert not bad_citations(), "\n".join(bad_citations())


def test_the_check_sees_outside_missing_and_wrong_section_citations(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "model.md").write_text("# Model\n\n## Router\n")
    (tmp_path / "torch_impl").mkdir()
    (tmp_path / "torch_impl" / "a.py").write_text(
        '"""See docs/model.md, "Router"."""\n# DESIGN.md §2\n# docs/gone.md\n'
        '# docs/model.md, "Experts"\n')
    assert bad_citations(tmp_path) == [
        "torch_impl/a.py:2: cites DESIGN.md, which is not in the repository",
        "torch_impl/a.py:3: docs/gone.md does not exist",
        "torch_impl/a.py:4: docs/model.md has no section 'Experts'",
    ]
