"""Progress for the command-line tools: a bar redrawn in place on a terminal, one line per
step in a log (stderr redirected to a file or a pipe)."""

from __future__ import annotations

import sys


def progress(done: int, total: int, label: str, stream=None) -> None:
    """Report that ``done`` of ``total`` steps are finished and ``label`` is the one under way
    (``done == total``: finished)."""
    stream = stream if stream is not None else sys.stderr
    if stream.isatty():
        width = 28
        filled = int(width * done / max(total, 1))
        end = "\n" if done >= total else ""
        stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:60]:<60}{end}")
    elif done < total:
        stream.write(f"[{done + 1}/{total}] {label}\n")
    stream.flush()
