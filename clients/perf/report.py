"""The benchmarks' sections in a Markdown report (docs/benchmarks.md): each section lies between its own start
and end markers, so one benchmark rewrites its section and leaves the others as they are."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, lines: list[str], start: str, end: str, before: str) -> None:
    """Put ``lines`` (the section, from its ``start`` marker to its ``end`` marker) into ``path``: in place of
    the section where it is, else before the marker ``before`` (another section's start), else at the end."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = "\n".join(lines).rstrip("\n") + "\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        text = head + block + ("\n" + after if after else "")
    elif before in text:
        head, rest = text.split(before, 1)
        text = head + block + "\n" + before + rest
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)
    print(f"wrote {path}")
