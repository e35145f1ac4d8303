"""The progress bar the command line and the demo show (rich: bytes, GB/s, time left)."""

from __future__ import annotations

from typing import Any


def progress_bar(**kwargs: Any) -> Any:
    """A `rich.progress.Progress` with a bytes/GB/s/ETA layout; kwargs go to `Progress`.

    A task given `stats=stream.stats` shows the stream's own rate (bytes read over its elapsed time),
    the number the summary prints after, not rich's estimate over the last updates.
    """
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.text import Text

    class StreamRate(ProgressColumn):
        def __init__(self) -> None:
            super().__init__()
            self.estimate = TransferSpeedColumn()

        def render(self, task: Any) -> Text:
            stats = task.fields.get("stats")
            if stats is None:
                return self.estimate.render(task)
            return Text(f"{stats.gbps:.2f} GB/s", style="progress.data.speed")

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), StreamRate(), TimeRemainingColumn())
    return Progress(*columns, **kwargs)
