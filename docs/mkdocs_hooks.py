"""mkdocs hooks (mkdocs.yml ``hooks:``): links from the site's pages to repository files outside docs/.

The pages link to the rest of the repository as GitHub renders them, relative to the page
(``../plugins/kvplug_s3/README.md``, ``../examples/serve_cpu.sh``). mkdocs knows only docs/,
so each such file is published with the site under ``repo/<path>``: Markdown files as pages
(their own relative links handled the same way, so a plugin README's links work too), other
files as they are. The links are rewritten to those copies. A link to a file that does not
exist is a warning, which ``strict: true`` turns into a failed build; links into docs/ and
their anchors are mkdocs' own ``validation``.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

log = logging.getLogger("mkdocs.plugins.kvplug")

ROOT = Path(__file__).resolve().parent.parent
#: Where the copies of repository files live in the site.
REPO_PREFIX = "repo/"
#: ``[text](target)``; a target with no scheme and not only an anchor is relative.
LINK = re.compile(r"(?<!\\)(\]\()(<[^>]+>|[^)\s]+)(\s+\"[^\"]*\")?\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose_lines(markdown: str) -> list[tuple[bool, str]]:
    """Each line, and whether it is prose (outside a fenced code block, where links are links)."""
    lines, fenced = [], False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
            lines.append((False, line))
        else:
            lines.append((not fenced, line))
    return lines


def _relative_targets(markdown: str) -> list[str]:
    targets = []
    for prose, line in _prose_lines(markdown):
        if prose:
            for match in LINK.finditer(line):
                target = match.group(2).strip("<>")
                if not SCHEME.match(target) and not target.startswith(("#", "/")):
                    targets.append(target)
    return targets


def _repo_path(site_uri: str) -> str:
    """The repository path of a site file: docs/<uri>, or the file a ``repo/`` copy was made of."""
    return site_uri.removeprefix(REPO_PREFIX) if site_uri.startswith(REPO_PREFIX) else f"docs/{site_uri}"


def _resolve(repo_path: str, target: str) -> tuple[str, str]:
    """A link's target as a repository path (``..`` resolved) and its ``#anchor`` part."""
    path, hash_, anchor = target.partition("#")
    if not path:
        return repo_path, hash_ + anchor
    return posixpath.normpath(posixpath.join(posixpath.dirname(repo_path), path)), hash_ + anchor


def _outside_docs(repo_path: str) -> bool:
    return not repo_path.startswith("docs/") and not repo_path.startswith("../")


def _nav_uris(nav: object) -> list[str]:
    """Every page path in mkdocs.yml's ``nav``."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [uri for item in nav for uri in _nav_uris(item)]
    if isinstance(nav, dict):
        return [uri for value in nav.values() for uri in _nav_uris(value)]
    return []


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Publish every repository file outside docs/ that the nav names or a page links to (and the ones those link to)."""
    published: set[str] = set()
    pending: list[File] = [file for file in files if file.src_uri.endswith(".md")]

    def publish(linked: str) -> None:
        if linked in published or not (ROOT / linked).is_file():
            return  # missing files are reported where the link is rewritten (mkdocs reports nav entries)
        published.add(linked)
        copy = File.generated(
            config, REPO_PREFIX + linked, abs_src_path=str(ROOT / linked), inclusion=InclusionLevel.NOT_IN_NAV
        )
        files.append(copy)
        if linked.endswith(".md"):
            pending.append(copy)

    for uri in _nav_uris(config.nav):
        if uri.startswith(REPO_PREFIX):
            publish(uri.removeprefix(REPO_PREFIX))
    while pending:
        page = pending.pop()
        repo_path = _repo_path(page.src_uri)
        for target in _relative_targets(Path(page.abs_src_path or "").read_text(encoding="utf-8")):
            linked, _ = _resolve(repo_path, target)
            if _outside_docs(linked):
                publish(linked)
    return files


def on_page_markdown(markdown: str, *, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Rewrite links to repository files outside docs/ (and, in published copies, to docs/) to their site paths."""
    site_uri = page.file.src_uri
    repo_path = _repo_path(site_uri)

    def rewrite(match: re.Match[str]) -> str:
        target = match.group(2).strip("<>")
        if SCHEME.match(target) or target.startswith(("#", "/")):
            return match.group(0)
        linked, anchor = _resolve(repo_path, target)
        if linked.startswith("../"):
            log.warning(f"{repo_path}: the link {target!r} leaves the repository")
            return match.group(0)
        if linked.startswith("docs/"):
            if not site_uri.startswith(REPO_PREFIX):
                return match.group(0)  # mkdocs checks links between docs pages itself
            linked_uri = linked.removeprefix("docs/")
        else:
            if not (ROOT / linked).is_file():
                log.warning(f"{repo_path}: the link {target!r} names {linked}, which is not a file in the repository")
                return match.group(0)
            linked_uri = REPO_PREFIX + linked
        relative = posixpath.relpath(linked_uri, posixpath.dirname(site_uri) or ".")
        return f"{match.group(1)}{relative}{anchor}{match.group(3) or ''})"

    return "".join(LINK.sub(rewrite, line) if prose else line for prose, line in _prose_lines(markdown))
