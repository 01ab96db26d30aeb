"""The ranks' per-rank files as the controller reads them (controller-side): stdout, stderr and the
faulthandler stack file of each rank (``protocol.rank_file``) grow for the pool's whole life, so a
command's part is read from the offsets taken before it (:func:`read_from`), and ``-s`` follows
them live, line by line (:class:`Tail`)."""

from __future__ import annotations

import os
from collections.abc import Callable


def file_size(path: str) -> int:
    """The file's size in bytes (0 where it cannot be read yet)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def read_from(path: str, offset: int, limit: int = 256 * 1024) -> str:
    """The file's text from ``offset`` on, at most ``limit`` bytes (then marked truncated)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit + 1)
    except OSError:
        return ""
    text = data[:limit].decode("utf-8", "replace")
    return text + ("\n[... output truncated ...]" if len(data) > limit else "")


#: Called with (rank, "stdout" | "stderr", one line) for live output (pytest ``-s``).
LiveOutput = Callable[[int, str, str], None]
#: How often (seconds) the controller looks for new rank output while a command runs with live
#: output.
LIVE_POLL_S = 0.05


class Tail:
    """Follows the ranks' output files from given offsets and hands on complete lines (all that is
    left at the end)."""

    def __init__(self, sink: LiveOutput, files: dict[tuple[int, str], tuple[str, int]]) -> None:
        self.sink = sink
        self.files = files
        self.partial: dict[tuple[int, str], str] = {}

    def pump(self, final: bool = False) -> None:
        for key, (path, offset) in self.files.items():
            size = file_size(path)
            if size > offset:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read(size - offset)
                self.files[key] = (path, offset + len(data))
                self.partial[key] = self.partial.get(key, "") + data.decode("utf-8", "replace")
            text = self.partial.pop(key, "")
            *lines, rest = text.split("\n")
            if final and rest:
                lines, rest = lines + [rest], ""
            for line in lines:
                self.sink(key[0], key[1], line)
            if rest:
                self.partial[key] = rest


__all__ = ["file_size", "read_from", "LiveOutput", "LIVE_POLL_S", "Tail"]
