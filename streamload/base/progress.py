"""Progress bars: the one a load draws on a terminal (tqdm, where transformers would draw its own; at 100%
only once the load returns, "finishing" at 99% between its last byte and then), and the demo's (rich:
bytes, GB/s, time left); byte counts in units that suit them."""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any, ParamSpec, TextIO, TypeVar

from streamload.base import settings

if TYPE_CHECKING:
    from streamload.base.stats import Stats

P = ParamSpec("P")
R = TypeVar("R")


def progress_bar(**kwargs: Any) -> Any:
    """A `rich.progress.Progress` with a bytes/GB/s/ETA layout; kwargs go to `Progress`.

    A task given `stats=stream.stats` shows the stream's own rate (bytes read over its elapsed time),
    the number the summary prints after, not rich's estimate over the last updates.
    """
    from rich import progress
    from rich.text import Text

    class StreamRate(progress.TransferSpeedColumn):
        def render(self, task: Any) -> Text:
            stats = task.fields.get("stats")
            if stats is None:
                return super().render(task)
            return Text(f"{stats.gbps:.2f} GB/s", style="progress.data.speed")

    columns = [progress.TextColumn("{task.description}"), progress.BarColumn(), progress.DownloadColumn()]
    return progress.Progress(*columns, StreamRate(), progress.TimeRemainingColumn(), **kwargs)


# -- the bar of a library load (load, load_into, from_pretrained) ---------------------------------------


def size(n: float) -> str:
    """A byte count in the unit that suits it (powers of 1000, as GB and GB/s elsewhere): "512 B",
    "1.5 KB", "12.3 MB", "1.23 GB"."""
    if n < 1000:
        return f"{int(n)} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if n < 999.5:
            return f"{n:.2f} {unit}" if unit == "GB" else f"{n:.1f} {unit}"
    return f"{n / 1000:.2f} TB"


def bars_enabled() -> bool:
    """Whether Hugging Face's switches leave progress bars on: `HF_HUB_DISABLE_PROGRESS_BARS`,
    `huggingface_hub.utils.disable_progress_bars()`, transformers' `logging.disable_progress_bar()`
    (each read only where already imported: one that is not imported was not switched), and tqdm's
    own `TQDM_DISABLE`."""
    if any(settings.switched_on(os.environ.get(name)) for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")):
        return False
    hub = sys.modules.get("huggingface_hub.utils.tqdm")
    if hub is not None and hub.are_progress_bars_disabled():
        return False
    logging = sys.modules.get("transformers.utils.logging")
    return logging is None or bool(logging.is_progress_bar_enabled())


def _after() -> float:
    """`STREAMLOAD_PROGRESS_AFTER`: a load that ends sooner draws no bar (none flashing by for a small model)."""
    return settings.PROGRESS_AFTER.get()


class LoadBar:
    """One bar over the streams a load opens (`watch`), drawn on a terminal by a thread (started with it)
    that reads their counters ten times a second (a load's loop, inside `load_into` or a framework's
    loader, is not ours to hook), once the load has run `after` seconds; tqdm draws it."""

    def __init__(self, what: str, after: float, out: TextIO) -> None:
        self.what, self.after, self.out = what, after, out
        self.stats: list[Stats] = []
        self._started = time.time()  # tqdm's clock, for its elapsed and time left
        self._bar: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="streamload-progress", daemon=True)
        self._thread.start()

    def watch(self, stats: Stats) -> None:
        """Count a stream's bytes on this bar."""
        self.stats.append(stats)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self._draw()
        self._draw(final=True)
        if self._bar is not None:
            self._bar.close()

    def _draw(self, final: bool = False) -> None:
        """Redraw the bar. Until `final` (the load returning) it stays below 100%: every byte read is not a
        load done (from_pretrained still places buffers, ties weights...), said as "finishing"."""
        streams = list(self.stats)
        total = sum(s.bytes_total for s in streams)
        if self._bar is None:
            if not total or time.time() - self._started < self.after:
                return
            self._bar = _tqdm_bar(self.what, total, self.out)
            self._bar.start_t = self._started  # the load's elapsed time, not the bar's
        done = sum(s.bytes_read for s in streams)
        seconds = sum(s.elapsed for s in streams)
        shown = min(done, total) if final else min(done, total * 99 // 100)
        self._bar.total, self._bar.n = total, shown
        self._bar.set_description_str(self.what if final or done < total else f"{self.what} (finishing)",
                                      refresh=False)  # fmt: skip
        self._bar.set_postfix_str(f"{size(done / seconds if seconds else 0)}/s", refresh=False)
        self._bar.refresh()


def _tqdm_bar(what: str, total: int, out: TextIO) -> Any:
    """A tqdm bar of bytes with the streams' own rate (bytes read over their elapsed time, as the CLI's
    summary prints it), and no tqdm monitor thread (ours redraws it)."""
    from tqdm import tqdm

    class Bar(tqdm):  # type: ignore[misc,type-arg]
        monitor_interval = 0

    fmt = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}{postfix}]"
    try:  # a terminal of no size (a pseudo-terminal nobody sized) would get nothing from tqdm: 80 x 24
        sized = min(os.get_terminal_size(out.fileno())) > 0
    except (OSError, ValueError, AttributeError):
        sized = False
    width: dict[str, Any] = {"dynamic_ncols": True} if sized else {"ncols": 80, "nrows": 24}
    return Bar(total=total, desc=what, file=out, unit="B", unit_scale=True, unit_divisor=1000, smoothing=0,
               bar_format=fmt, leave=True, **width)  # fmt: skip


_CURRENT: ContextVar[LoadBar | None] = ContextVar("streamload_load_bar", default=None)


@contextmanager
def loading(what: str = "Loading weights", after: float | None = None) -> Iterator[LoadBar | None]:
    """A bar on stderr for the streams opened inside (`api.iter` calls `watch`), where transformers would
    draw one: stderr is a terminal, no switch turned bars off, the load ran `after` seconds (default
    `STREAMLOAD_PROGRESS_AFTER`, else 1). Never in a log or a pipe; nothing where tqdm is not installed.
    Inside another `loading`, the outer bar counts these streams too. Yields the bar, or None."""
    outer = _CURRENT.get()
    isatty = getattr(sys.stderr, "isatty", None)
    if outer is not None or not (isatty is not None and isatty() and bars_enabled() and find_spec("tqdm")):
        yield outer
        return
    bar = LoadBar(what, _after() if after is None else after, sys.stderr)
    token = _CURRENT.set(bar)
    try:
        yield bar
    finally:
        _CURRENT.reset(token)
        bar.stop()


def shown(load: Callable[P, R]) -> Callable[P, R]:
    """`load` run inside `loading()`: its streams on one bar (from_pretrained, whatever loads it does)."""

    @functools.wraps(load)
    def inside(*args: P.args, **kwargs: P.kwargs) -> R:
        with loading():
            return load(*args, **kwargs)

    return inside


def watch(stats: Stats) -> None:
    """Count a new stream's bytes on the bar of the `loading` it was opened in, if any."""
    bar = _CURRENT.get()
    if bar is not None:
        bar.watch(stats)
