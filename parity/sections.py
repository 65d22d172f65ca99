"""Sections of BENCHMARKS.md that separate commands own (`## GPU`: python -m parity.gpu;
`## Training parity`: python -m parity.train; the tuning history and the time model's,
by hand): read one, or replace one in place."""


def _bounds(lines: list, heading: str):
    """(heading line, end) of the section under `heading` (to the next '## ' heading or
    the end), or None when absent."""
    try:
        start = lines.index(heading)
    except ValueError:
        return None
    return start, next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                       len(lines))


def section_body(md_text: str, heading: str):
    """The text under the line `heading`, without surrounding blank lines, or None."""
    lines = md_text.split("\n")
    bounds = _bounds(lines, heading)
    return None if bounds is None else "\n".join(lines[bounds[0] + 1:bounds[1]]).strip("\n")


def replace_section(md_text: str, body: str, heading: str) -> str:
    """md_text with the body under the line `heading` replaced by `body`; the section is
    appended when absent."""
    lines = md_text.split("\n")
    bounds = _bounds(lines, heading)
    if bounds is None:
        return md_text.rstrip("\n") + f"\n\n{heading}\n\n{body.rstrip()}\n"
    start, end = bounds
    tail = lines[end:]
    new = lines[:start + 1] + [""] + body.rstrip("\n").split("\n") + [""]
    return "\n".join(new + tail) if tail else "\n".join(new)
