"""Rank 0's training progress for `loom train`: a tqdm bar on a terminal, plain lines elsewhere.

tqdm redraws its bar with ``\\r``; written to a log file or a CI log that becomes one long line of bars
with the job's log lines spliced into it. So when the progress stream is not a terminal
(``stream.isatty()`` is false) :class:`Progress` prints one plain line every ``every`` steps instead::

    train step 40/400 (10%) | loss 5.123 | tok_s 4,512 | 0:01:30 elapsed, ETA 0:13:30

The interface is the part of tqdm the job uses (``set_postfix``, ``update``, ``write``, ``close``).
"""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Progress of a run of ``total`` steps that starts at step ``initial``.

    Args:
        total: the run's last step. initial: the step it starts from (a resumed run).
        enabled: False prints nothing (``log.progress: false``, and every rank but 0).
        every: with a stream that is not a terminal, a line every ``every`` steps (and at the last step
            reached); None = ``max(1, total // 20)``, about twenty lines per run.
        stream: where progress goes (default ``sys.stderr``); a terminal gets the tqdm bar.
        desc: the label (``train``).
    """

    def __init__(self, total: int, initial: int = 0, *, enabled: bool = True, every: int | None = None,
                 stream: TextIO | None = None, desc: str = "train"):
        self.total, self.step, self.desc = int(total), int(initial), desc
        self.stream = sys.stderr if stream is None else stream
        self.every = int(every) if every else max(1, self.total // 20)
        self.mode = "off" if not enabled else ("bar" if _isatty(self.stream) else "lines")
        self.postfix: dict[str, Any] = {}
        self._start_step, self._t0 = self.step, time.perf_counter()
        self._printed = self.step
        self.bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, desc=desc, unit="step",
                            file=self.stream)

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        """Values shown after the step count (``loss``, ``tok_s``); the next bar redraw or line shows them."""
        self.postfix.update(values)
        if self.bar is not None:
            self.bar.set_postfix(refresh=refresh, **values)

    def update(self, n: int = 1) -> None:
        """``n`` more steps done."""
        self.step += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.mode == "lines" and (self.step % self.every == 0 or self.step >= self.total):
            self._line()

    def write(self, line: str, file: TextIO | None = None) -> None:
        """Print a log line (to ``file``, default stdout) without breaking the bar."""
        file = sys.stdout if file is None else file
        if self.bar is not None:
            self.bar.write(line, file=file)
        else:
            print(line, file=file, flush=True)

    def close(self) -> None:
        """End the bar; in line mode, report the last step if its line was not printed yet (a stopped run)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.mode == "lines" and self.step != self._printed:
            self._line()

    def _line(self) -> None:
        self._printed = self.step
        elapsed = time.perf_counter() - self._t0
        done = self.step - self._start_step
        parts = [f"{self.desc} step {self.step}/{self.total} ({100 * self.step // max(1, self.total)}%)"]
        parts += [f"{k} {v}" for k, v in self.postfix.items()]
        eta = f", ETA {_clock(elapsed / done * (self.total - self.step))}" if done > 0 else ""
        parts.append(f"{_clock(elapsed)} elapsed{eta}")
        print(" | ".join(parts), file=self.stream, flush=True)
