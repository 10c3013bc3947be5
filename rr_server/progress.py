"""Live progress on stderr for rr's commands (a server starting, the doctor's checks), drawn by ``rich``.

On a terminal the running step is one line updated in place (a spinner, the elapsed time, a detail such as the
server log's last line) and finished steps are printed above it; anywhere else (CI logs, pipes, files) nothing
is redrawn: only plain lines, no escape codes. stdout is never written, so ``--json`` output stays one document.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from types import TracebackType

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

__all__ = ["Steps", "stderr_console", "last_log_line", "log_tail"]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def stderr_console() -> Console:
    """rich's console on stderr: no markup or highlighting of what it prints (log lines hold brackets)."""
    return Console(stderr=True, highlight=False, markup=False, emoji=False)


def _lines_at_end(path: Path | None, size: int) -> list[str]:
    """The cleaned lines in the last ``size`` bytes of ``path``, trailing blank ones dropped (none if unreadable).

    A line the window cuts at its start is dropped; a progress bar redrawn with carriage returns is one line in its
    last state; colour codes are stripped.
    """
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            start = max(0, f.tell() - size)
            f.seek(start)
            raw = f.read().decode(errors="replace").split("\n")
    except OSError:
        return []
    lines = [_ANSI.sub("", line).rsplit("\r", 1)[-1].rstrip() for line in raw[1 if start else 0 :]]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def last_log_line(path: Path | None) -> str:
    """The last non-empty line of a log file ('' when there is none yet)."""
    return next((line.strip() for line in reversed(_lines_at_end(path, 8192)) if line.strip()), "")


def log_tail(path: Path | None, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file, cleaned as :func:`last_log_line` shows them."""
    return "\n".join(_lines_at_end(path, 400 * lines)[-lines:])


class Steps:
    """One running step with a spinner and its elapsed time (terminal only), and a line per finished step.

    ``every``: off a terminal, :meth:`update` prints its text as a plain line at most once per ``every`` seconds
    (a heartbeat in CI logs); on a terminal it redraws the running line in place.
    """

    def __init__(self, console: Console | None = None, every: float = 10.0) -> None:
        self.console = console or stderr_console()
        self.every = every
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._label = ""
        self._depth = 0
        self._t0 = self._last_beat = time.monotonic()

    @property
    def live(self) -> bool:
        """True when lines are redrawn in place (stderr is a terminal)."""
        return self.console.is_terminal

    def __enter__(self) -> Steps:
        """Start drawing (re-entrant: a helper given running steps may enter them again)."""
        self._depth += 1
        if self.live and self._progress is None:
            self._progress = Progress(
                SpinnerColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}", markup=False),
                console=self.console,
                transient=True,
            )
            self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._depth -= 1
        if self._depth == 0 and self._progress is not None:
            self._progress.stop()
            self._progress, self._task = None, None

    def start(self, label: str) -> None:
        """Begin a step (the previous one, if any, is dropped from the live line)."""
        self._label, self._t0 = label, time.monotonic()
        self._last_beat = self._t0
        if self._progress is not None:
            if self._task is not None:
                self._progress.remove_task(self._task)
            self._task = self._progress.add_task(self._fit(label))

    def elapsed(self) -> float:
        """Seconds since the running step started."""
        return time.monotonic() - self._t0

    def update(self, detail: str) -> None:
        """The running step's detail: redrawn on a terminal, a heartbeat line elsewhere (see ``every``)."""
        if self._progress is not None and self._task is not None:
            text = f"{self._label} | {detail}" if detail else self._label
            self._progress.update(self._task, description=self._fit(text), refresh=True)
        elif not self.live and time.monotonic() - self._last_beat >= self.every:
            self._last_beat = time.monotonic()
            self.line(f"{self._label}: {self.elapsed():.0f}s" + (f" | {detail}" if detail else ""))

    def line(self, text: str) -> None:
        """A permanent line (above the live one on a terminal); never wrapped or styled."""
        self.console.print(Text(text), soft_wrap=True)

    def _fit(self, text: str) -> str:
        """One terminal line: room for the spinner and the elapsed time, the rest cut with an ellipsis."""
        room = max(20, self.console.width - 12)
        return text if len(text) <= room else text[: room - 1] + "…"
