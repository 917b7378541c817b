"""Rank 0's progress display: tqdm's bar on a terminal, plain lines in a log file.

A bar redrawn with carriage returns is noise in a file (a Snakemake job's log), so when stderr
is not a terminal the display prints one line every ``every_s`` seconds (and at the end).
"""

from __future__ import annotations

import sys
import time

PLAIN_EVERY_S = 30.0


class ProgressDisplay:
    """``update()`` after every step, ``show_loss()`` at log points, ``close()`` once (idempotent)."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool, every_s: float = PLAIN_EVERY_S):
        self.total, self.step, self.desc, self.every_s = total, initial, desc, every_s
        self.enabled, self.loss, self.bar = enabled, None, None
        self.t0, self.step0, self.last = time.monotonic(), initial, time.monotonic()
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True,
                            mininterval=2.0)

    def update(self) -> None:
        self.step += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled and time.monotonic() - self.last >= self.every_s:
            self._line()

    def show_loss(self, loss: float) -> None:
        self.loss = loss
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.step != self.step0:
            self._line()
        self.enabled, self.bar = False, None

    def _line(self) -> None:
        now = time.monotonic()
        rate = (self.step - self.step0) / max(now - self.t0, 1e-9)
        loss = f", loss {self.loss:.4f}" if self.loss is not None else ""
        print(f"[commlab] {self.desc}: step {self.step}/{self.total} ({100 * self.step / max(self.total, 1):.0f}%)"
              f"{loss}, {rate:.2f} steps/s", file=sys.stderr, flush=True)
        self.last = now
