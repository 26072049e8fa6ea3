"""The benchmarks' sections of the Markdown report (docs/benchmarks.md). Each section lies between its own
markers, ``<!-- NAME -->`` and ``<!-- /NAME -->``, so a benchmark rewrites its own section and leaves the rest
of the page as it is."""

from __future__ import annotations

from pathlib import Path

DEMO_NAMES = {"llava": "LLaVA", "qwen2vl": "Qwen2-VL", "qwen2audio": "Qwen2-Audio"}  # demo family -> its name


def markers(name: str) -> tuple[str, str]:
    """The start and end markers of section ``name``."""
    return f"<!-- {name} -->", f"<!-- /{name} -->"


def _find(text: str, name: str) -> tuple[int, int] | None:
    """Where section ``name``'s text lies in ``text``: (just after its start marker, its end marker), or None."""
    start, end = markers(name)
    i = text.find(start)
    if i < 0:
        return None
    j = text.find(end, i)
    if j < 0:
        raise ValueError(f"{start} has no {end} after it")
    return i + len(start), j


def read_section(path: Path, name: str) -> str | None:
    """The text between section ``name``'s markers in ``path``, or None where the file or the section is absent."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    where = _find(text, name)
    return text[where[0]:where[1]] if where else None


def write_section(path: Path, name: str, lines: list[str], before: str | None = None) -> None:
    """Put ``lines`` (the section's text, without its markers) between section ``name``'s markers in ``path``, in
    place of the text there. Where the section is absent it goes in with its markers: before section ``before``'s
    start marker when there is one, else at the end of the file."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    body = "\n".join(lines).strip("\n")
    where = _find(text, name)
    if where:
        text = text[:where[0]] + "\n" + body + "\n" + text[where[1]:]
    else:
        start, end = markers(name)
        block = f"{start}\n{body}\n{end}\n"
        at = text.find(markers(before)[0]) if before else -1
        text = text[:at] + block + "\n" + text[at:] if at >= 0 else text.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote section {name} of {path}")


def settings_text(config: dict, prefix: str = "") -> str:
    """Config-file settings as one line: ``{"vllm": {"prefill_calls": 2}}`` as ``vllm.prefill_calls: 2``."""
    return ", ".join(settings_text(v, f"{prefix}{k}.") if isinstance(v, dict) else f"{prefix}{k}: {v}"
                     for k, v in config.items())
