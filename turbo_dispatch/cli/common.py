"""What the ``turbo-dispatch`` command modules share: the usage error, table printing and the
argument types more than one command takes."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import torch


class UsageError(Exception):
    """A command-line combination that makes no sense; reported like any other error."""


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    """Plain-text table with left-aligned columns (the last column is not padded)."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        padded = [str(c).ljust(w) for c, w in zip(cells[:-1], widths)] + [str(cells[-1])]
        return (indent + "  ".join(padded)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


#: The largest matrix size the size options take: kernels index with 32-bit ints, and a larger
#: value cannot describe a tensor torch could allocate.
MAX_SIZE = 2**31 - 1


def size_arg(text: str) -> int:
    """argparse type: a matrix size, an integer from 1 to ``MAX_SIZE``."""
    value = positive_int(text)
    if value > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to {MAX_SIZE}, got {value}")
    return value


def device_arg(requested: str | None) -> str:
    """The device type of a ``--device`` option (explain, tune): the GPU when torch sees one, else
    the CPU; asking for cuda without a GPU is a usage error."""
    if requested is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        # Adapters probe the live device (arch, library) to decide, so there is nothing to ask.
        raise UsageError("--device cuda: torch sees no GPU on this machine (torch.cuda.is_available() is False)")
    return requested


def readable_db_file(path: Path, command: str) -> Path:
    """``path`` if it is a tuning-DB file this command can read; a missing path, a directory, a
    FIFO, a device or an unreadable file is a usage error naming the path (never read as empty)."""
    from ..tuning import store

    try:
        store.check_readable(Path(path))
    except (OSError, store.TuningDBPathError) as exc:
        raise UsageError(f"{command}: {exc}") from None
    return path
