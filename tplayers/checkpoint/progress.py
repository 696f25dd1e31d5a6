"""A tiny progress bar on stderr (no tqdm dependency); only one rank draws it."""

from __future__ import annotations

import sys
import time
from typing import Optional

#: Below this many bytes a bar is not worth drawing when ``progress=None``.
AUTO_MIN_BYTES = 256 << 20


class Progress:
    """Count bytes and redraw ``desc [#####.....] 42% 105/250 MB 310 MB/s`` at most 10 times a second.

    >>> bar = Progress(100, "save", enabled=False)
    >>> bar.update(40); bar.done
    40
    """

    def __init__(self, total: int, desc: str, enabled: Optional[bool], stream=None) -> None:
        self.total, self.desc, self.done = max(int(total), 0), desc, 0
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = self.total >= AUTO_MIN_BYTES and getattr(self.stream, "isatty", lambda: False)()
        self.enabled = bool(enabled)
        self._t0 = self._last = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last >= 0.1 or self.done >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        rate = self.done / max(now - self._t0, 1e-9) / 1e6
        self.stream.write(
            f"\r{self.desc} [{bar}] {frac:4.0%} {self.done / 1e6:.0f}/{self.total / 1e6:.0f} MB {rate:.0f} MB/s"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
