"""How the command line prints: tables that fit the terminal, JSON, and a closed pipe.

Tables: every column but the last keeps its width (a cell longer than CELL_MAX is cut with '...');
the last column (next_safe_action, an error) takes the rest of the terminal's width ($COLUMNS, else the
terminal's) and wraps onto continuation lines, never cut; written to a pipe or a file, lines are whole.
JSON: always real JSON (datetimes as text, intervals as seconds), never a Python repr.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

CELL_MAX = 60  # a cell of any column but the last is cut beyond this
LAST_MIN = 24  # the last column is at least this wide, even on a narrow terminal
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a command its pipe's reader stopped


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, timedelta):
        return f"{value.total_seconds():.1f}s"
    if isinstance(value, dict | list):
        return json.dumps(value, default=str)
    return str(value)


def terminal_width() -> int | None:
    """$COLUMNS, else the width of the terminal stdout is; None when stdout is no terminal (a pipe or a
    file gets whole lines: grep finds a next safe action on one line)."""
    if os.environ.get("COLUMNS", "").isdigit() or sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str], width: int | None = None) -> str:
    """``rows`` as a table of ``columns`` fitting ``width`` (default: terminal_width(); None: no wrapping)."""
    width = width or terminal_width()
    body = [[cell(r.get(c)) for c in columns] for r in rows]
    for line in body:
        for i in range(len(columns) - 1):
            if len(line[i]) > CELL_MAX:
                line[i] = line[i][:CELL_MAX - 3] + "..."
    widths = [max([len(c)] + [len(b[i]) for b in body]) for i, c in enumerate(columns)]
    indent = sum(widths[:-1]) + 2 * (len(columns) - 1)
    last = max(LAST_MIN, width - indent) if width else 1 << 30
    out = []
    for line in [list(columns), *body]:
        head = "  ".join(v.ljust(w) for v, w in zip(line[:-1], widths[:-1], strict=True))
        pieces = textwrap.wrap(line[-1], last, break_long_words=True, break_on_hyphens=False) or [""]
        out.append(((head + "  ") if head else "") + pieces[0])
        out += [" " * indent + piece for piece in pieces[1:]]
    return "\n".join(line.rstrip() for line in out)


def to_json(value: Any) -> str:
    return json.dumps(value, default=_plain, indent=2)


def _plain(value: Any) -> Any:
    if isinstance(value, timedelta):
        return value.total_seconds()
    return str(value)


def json_stream(rows: Iterable[dict[str, Any]]) -> None:
    """print(to_json(list(rows))), written one row at a time: the same text, without the list. A generator
    of rows is closed on the way out, before its connection is (a closed pipe ends the listing early)."""
    out = sys.stdout
    first = True
    source = iter(rows)
    try:
        for row in source:
            out.write("[\n  " if first else ",\n  ")
            out.write(to_json(row).replace("\n", "\n  "))
            first = False
        out.write("[]\n" if first else "\n]\n")
        out.flush()
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


def pipe_closed() -> int:
    """The reader of stdout went away (``pglane status | head -1``): as the Python docs advise, point
    stdout at devnull so that the interpreter's last flush finds nothing to complain about; exit 141."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE
