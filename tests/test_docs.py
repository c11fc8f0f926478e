"""The user-facing docs (README.md, docs/, tests/README.md): generated where they can be, short where they must
be, pointing only at what exists, and speaking only of what a user has."""

import re
from pathlib import Path

import pytest

from fitone.cli.options import FLAGS
from fitone.cli.reference import REGENERATE, options_page

ROOT = Path(__file__).resolve().parent.parent
USER_DOCS = [ROOT / "README.md", ROOT / "tests" / "README.md", ROOT / "bench" / "NOTES.md",
             *sorted((ROOT / "docs").glob("*.md"))]
# this team's own GPU access, which a user does not have: the machines it borrows and the tool that runs them
TEAM_ONLY = re.compile(r"\blent\b|\blend|device call|device tool|device time|\bcarry\b|\bcarried\b|borrow|"
                       r"nvidia-h200|shared/gpu|\.whl\b|\$OUT\b|\banchors\b", re.IGNORECASE)


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_docs_options_md_is_the_flag_table_as_generated():
    page = (ROOT / "docs" / "options.md").read_text()
    assert page == options_page(), f"docs/options.md is stale: regenerate it with `{REGENERATE}`"


def test_every_training_flag_is_described_on_the_options_page():
    page = (ROOT / "docs" / "options.md").read_text()
    missing = [name for name in FLAGS if f"| `{name}` |" not in page]
    assert missing == []


def test_the_readme_is_at_most_200_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("doc", USER_DOCS, ids=_name)
def test_no_user_facing_doc_speaks_of_the_team_s_own_gpu_access(doc):
    hits = [f"{_name(doc)}:{n}: {line.strip()}" for n, line in enumerate(doc.read_text().splitlines(), 1)
            if TEAM_ONLY.search(line)]
    assert hits == [], "say how to do it on any CUDA machine instead:\n" + "\n".join(hits)


@pytest.mark.parametrize("doc", USER_DOCS, ids=_name)
def test_every_path_a_doc_points_at_exists(doc):
    text = doc.read_text()
    links = re.findall(r"\]\(([^)#\s]+)", text)  # relative markdown links, from the doc's folder
    missing = [link for link in links if "://" not in link and not (doc.parent / link).exists()]
    # results folders and repository files named in code spans, from the repository root
    named = re.findall(r"`((?:bench|docs|fitone|tests|scripts|recipes|examples)/[\w./-]+?)/?`", text)
    named += [f"bench/results/{d}" for d in re.findall(r"`(20\d\d-\d\d-\d\d-[\w-]+)/?`", text)]
    missing += [path for path in named if "*" not in path and not (ROOT / path).exists()]
    assert missing == []


def _anchors(doc: Path) -> set[str]:
    """GitHub's ids for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", doc.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", USER_DOCS, ids=_name)
def test_every_anchor_a_doc_links_to_is_a_heading_there(doc):
    links = re.findall(r"\]\(([^)\s]*\.md)#([^)\s]+)\)", doc.read_text())
    missing = [f"{page}#{anchor}" for page, anchor in links if anchor not in _anchors(doc.parent / page)]
    assert missing == []


def test_each_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if f"](docs/{p.name})" not in readme]
    assert unlinked == []
