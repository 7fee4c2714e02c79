"""`RichProgress`: the terminal progress bar of a fetch (one line per file).

On a terminal it redraws in place; elsewhere (a log file, a test) rich prints the final
state once, and the fetch logs its own start and end lines.
"""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


class RichProgress:
    def __init__(self) -> None:
        self._progress = Progress(
            TextColumn("fetching {task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._tasks: dict[str, tuple[TaskID, int]] = {}

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._progress.stop()

    def start(self, name: str, total: int, done: int) -> None:
        task = self._progress.add_task(name, total=total, completed=done)
        self._tasks[name] = (task, total)

    def advance(self, name: str, size: int) -> None:
        self._progress.advance(self._tasks[name][0], size)

    def finish(self, name: str) -> None:
        task, total = self._tasks[name]
        self._progress.update(task, completed=total)
