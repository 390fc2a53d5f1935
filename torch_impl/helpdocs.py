"""``moezero docs``: where the documentation is for an installed user, and its pages.

The wheel ships the repository's ``docs/*.md`` as ``moezero/docs/`` (package data); in a
checkout they are the repository's ``docs/``. ``listing`` names the folder and each page with
its title; ``page`` is one page's text.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from moezero.config import ConfigError

INSTALLED = Path(__file__).parent / "docs"
"""The pages in an installed wheel."""
CHECKOUT = Path(__file__).resolve().parent.parent / "docs"
"""The pages in a source checkout (an editable install)."""


def docs_folder() -> Path | None:
    """The folder holding the pages: the installed copy, else the checkout's; None if neither."""
    for folder in (INSTALLED, CHECKOUT):
        if any(folder.glob("*.md")):
            return folder
    return None


def pages(folder: Path) -> dict[str, str]:
    """{topic: title} of every page (the topic is the file name without ``.md``)."""
    found = {}
    for path in sorted(folder.glob("*.md")):
        first = path.read_text().partition("\n")[0]
        found[path.stem] = first.lstrip("# ").strip()
    return found


def listing(folder: Path | None) -> str:
    """``moezero docs``: the folder, then one line per page."""
    if folder is None:
        return "moezero docs: this installation holds no documentation pages"
    topics = pages(folder)
    width = max(map(len, topics), default=0)
    lines = [f"{name:<{width}}  {title}" for name, title in topics.items()]
    return "\n".join([f"documentation pages in {folder} (moezero docs TOPIC prints one):",
                      *lines])


def page(folder: Path | None, topic: str) -> str:
    """One page's Markdown; ConfigError (one line, the close topics) for an unknown one."""
    topics = pages(folder) if folder is not None else {}
    name = topic.removesuffix(".md")
    if name not in topics:
        close = difflib.get_close_matches(name, list(topics), n=4) or list(topics)
        raise ConfigError("docs", f"no page '{name}' (pages: {', '.join(close)})", "moezero docs")
    return (folder / f"{name}.md").read_text()
