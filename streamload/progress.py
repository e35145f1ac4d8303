"""The progress bar the command line and the demo show (rich: bytes, GB/s, time left)."""

from __future__ import annotations

from typing import Any


def progress_bar(**kwargs: Any) -> Any:
    """A `rich.progress.Progress` with a bytes/GB/s/ETA layout; kwargs go to `Progress`."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())  # fmt: skip
    return Progress(*columns, **kwargs)
