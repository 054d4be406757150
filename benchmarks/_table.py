"""The tail every benchmark shares: print its table and write it under ``benchmarks/results/``."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

RESULTS = pathlib.Path(__file__).resolve().parent / "results"

__all__ = ["RESULTS", "results_path", "write_results"]


def results_path(name: str) -> pathlib.Path:
    """``benchmarks/results/<name>.md``."""
    return RESULTS / f"{name}.md"


def write_results(out: str | pathlib.Path, text: str | Sequence[str], *, show: str | Sequence[str] | None = None) -> pathlib.Path:
    """Write ``text`` (a string, or lines joined with newlines) to ``out``, creating its
    folder; print ``show`` (default: the text itself; an empty sequence: nothing) and
    then where it was written. Returns the path."""
    body = text if isinstance(text, str) else "\n".join(text)
    shown = body if show is None else show if isinstance(show, str) else "\n".join(show)
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    if shown:
        print(shown)
    print(f"wrote {path}")
    return path
