"""Every relative link in the repository's documents resolves inside the repository, and
every #anchor names a heading of its target document (GitHub's heading ids)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ("README.md", "BENCHMARKS.md", "bridge/SPEC.md")
# [text](target) and ![alt](target); the target up to whitespace or ')'
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(text):
    """(path, anchor) of each link that is not a URL (path '' for a pure #anchor;
    anchor None when there is none)."""
    for target in LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue
        path, _, anchor = target.partition("#")
        yield path, anchor if "#" in target else None


def heading_ids(markdown):
    """The ids GitHub gives a document's headings: lowercased, punctuation but '-' and '_'
    dropped, spaces to '-', a repeated id suffixed -1, -2, ... (headings inside code
    blocks are not headings)."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    ids, seen = [], {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(base, 0)
        seen[base] = n + 1
        ids.append(base if n == 0 else f"{base}-{n}")
    return set(ids)


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve_inside_the_repository(doc):
    path = ROOT / doc
    links = [p for p, _ in relative_links(path.read_text()) if p]
    assert links or doc == "BENCHMARKS.md", f"{doc} has no relative links: is the pattern right?"
    for target in links:
        resolved = (path.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{doc}: {target} leaves the repository"
        assert resolved.exists(), f"{doc}: {target} does not exist"


@pytest.mark.parametrize("doc", DOCS)
def test_anchors_name_a_heading_of_their_target(doc):
    path = ROOT / doc
    for target, anchor in relative_links(path.read_text()):
        if anchor is None or not (target == "" or target.endswith(".md")):
            continue
        md = path if target == "" else (path.parent / target).resolve()
        assert anchor in heading_ids(md.read_text()), f"{doc}: {target}#{anchor} names no heading"


def test_the_readme_links_the_contract_and_every_reference_section():
    readme = (ROOT / "README.md").read_text()
    assert "(bridge/SPEC.md)" in readme
    # the long reference moved out of the README; its front page still leads to each part
    spec = (ROOT / "bridge/SPEC.md").read_text()
    reference = spec[spec.index("\n# Reference"):]
    linked = {a for t, a in relative_links(readme) if t == "bridge/SPEC.md"}
    sections = heading_ids("\n".join(re.findall(r"^## .+$", reference, flags=re.M)))
    assert sections and sections <= linked, sections - linked


def test_the_link_pattern_catches_bad_links():
    text = "[a](../shared/SPEC.md) [b](https://x.org/y) [c](#top) ![d](img/p.png#x)"
    assert list(relative_links(text)) == [("../shared/SPEC.md", None), ("", "top"),
                                          ("img/p.png", "x")]
    bad = (ROOT / "README.md").parent / "../shared/SPEC.md"
    assert not bad.resolve().is_relative_to(ROOT)


def test_heading_ids_follow_github():
    md = ("# A `b` (c)\n## torch.compile / export / autocast\n## A `b` (c)\n"
          "```python\n# not a heading\n```\n### Over `context_group`, 2-D\n")
    assert heading_ids(md) == {"a-b-c", "torchcompile--export--autocast", "a-b-c-1",
                               "over-context_group-2-d"}
