"""Every relative link in the repository's documents resolves inside the repository
(the contract moved into it: bridge/SPEC.md)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ("README.md", "BENCHMARKS.md", "bridge/SPEC.md")
# [text](target) and ![alt](target); the target up to whitespace or ')'
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(text):
    """Link targets that are paths (no scheme, no pure #anchor), without their #anchor."""
    for target in LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        yield target.split("#", 1)[0]


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve_inside_the_repository(doc):
    path = ROOT / doc
    links = list(relative_links(path.read_text()))
    assert links or doc == "BENCHMARKS.md", f"{doc} has no relative links: is the pattern right?"
    for target in links:
        resolved = (path.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{doc}: {target} leaves the repository"
        assert resolved.exists(), f"{doc}: {target} does not exist"


def test_the_readme_links_the_contract():
    assert "(bridge/SPEC.md)" in (ROOT / "README.md").read_text()


def test_the_link_pattern_catches_bad_links():
    text = "[a](../shared/SPEC.md) [b](https://x.org/y) [c](#top) ![d](img/p.png#x)"
    assert list(relative_links(text)) == ["../shared/SPEC.md", "img/p.png"]
    bad = (ROOT / "README.md").parent / "../shared/SPEC.md"
    assert not bad.resolve().is_relative_to(ROOT)
