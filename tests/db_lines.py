"""Tuning-DB files written line by line for tests that read them back (``store.parse``,
``turbo-dispatch db show``): a header, this machine's CPU stamp, then the given entries."""
from __future__ import annotations

import json

from turbo_dispatch.tuning import store
from turbo_dispatch.tuning.stamp import current_stamp


def db_file(path, entries: list[dict]):
    """Writes ``entries`` (result lines as dicts) after a header and the CPU stamp; returns ``path``."""
    header = {"type": "header", "format": store.FORMAT, "version": store.VERSION}
    lines = [header, current_stamp("cpu").to_json(), *entries]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
