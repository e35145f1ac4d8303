"""A fleet: replicas (or nodes) that are not already in one process group, loading cooperatively.

They meet through torch's own rendezvous, nothing of streamload's: a `TCPStore` that rank 0 serves at
an address every member knows, and a gloo group built on it. The address and the world size come from
the call (`Fleet("10.0.0.1:29500", world_size=4, rank=2)`) or from the environment torch's launchers
already set (`MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK`: torchrun, Kubernetes' PyTorchJob,
SLURM wrappers), which `cooperative=True` reads when no `torch.distributed` group is initialised.
The group is streamload's own: the process's default group, if any, is left alone. A process joins a
fleet once; later loads of the same fleet reuse its group (and its store, for a lost member:
cooperative/lost_rank.py).

>>> import streamload
>>> fleet = streamload.Fleet("10.0.0.1:29500", world_size=4, rank=2)
>>> state = streamload.load("s3://bucket/model/", cooperative=fleet)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from streamload.base.errors import StreamloadError

log = logging.getLogger("streamload")

ENVIRONMENT = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


@dataclass(frozen=True)
class Fleet:
    """The members of a cooperative load: `address` ("host:port", which rank 0 serves the store at),
    `world_size`, this process's `rank`, and how long to wait for the others (forming the group and
    each exchange)."""

    address: str
    world_size: int
    rank: int
    timeout: timedelta = timedelta(minutes=5)

    def __post_init__(self) -> None:
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"Fleet address must be 'host:port', not {self.address!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"Fleet world_size must be a positive int, not {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"Fleet rank must be in [0, {self.world_size}), not {self.rank!r}")

    @classmethod
    def from_env(cls) -> Fleet | None:
        """The fleet torch's launch variables describe, or None where they are not all set."""
        values = [os.environ.get(name) for name in ENVIRONMENT]
        if not all(values):
            return None
        addr, port, world, rank = values
        try:
            return cls(f"{addr}:{int(port)}", int(world), int(rank))  # type: ignore[arg-type]
        except ValueError as exc:
            names = ", ".join(ENVIRONMENT)
            raise ValueError(f"the launch environment ({names}) does not name a fleet: {exc}") from None

    def forget(self) -> None:
        """Drop this process's group of the fleet (a member was lost): the next load forms it anew."""
        with _LOCK:
            _JOINED.pop(self, None)

    def joined_store(self) -> Any | None:
        """The fleet's store where this process joined the fleet already (else None: joining is a
        rendezvous of every member, which a member that failed before its load must not wait for)."""
        with _LOCK:
            return _JOINED.get(self, (None, None))[0]

    def join(self) -> tuple[Any, Any]:
        """This process's (store, gloo group) of the fleet: formed on first use (a rendezvous of every
        member, up to `timeout`), then reused."""
        with _LOCK:
            if self not in _JOINED:
                _JOINED[self] = _form(self)
            return _JOINED[self]


_JOINED: dict[Fleet, tuple[Any, Any]] = {}
_LOCK = threading.Lock()


def _form(fleet: Fleet) -> tuple[Any, Any]:
    import torch.distributed as dist

    host, _, port = fleet.address.rpartition(":")
    me = f"rank {fleet.rank} of {fleet.world_size}"
    try:  # a name that does not resolve never will within the timeout: said at once, not after it
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise StreamloadError(f"joining the fleet at {fleet.address} as {me}: cannot resolve {host!r}: {exc}") from None
    # Under torchrun its agent serves the store at MASTER_ADDR:MASTER_PORT already: join it as a client.
    serve = fleet.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    what = f"the other {fleet.world_size - 1} member(s) to join" if serve else "rank 0 to serve the fleet's store"
    bound = fleet.timeout.total_seconds()
    try:
        with _saying_while(f"fleet {fleet.address}, {me}: waiting for {what}", bound):
            if not serve and not _listening(host, int(port), time.monotonic() + bound):
                raise StreamloadError(
                    f"joining the fleet at {fleet.address} as {me}: nothing served the fleet's store there within "
                    f"{bound:.0f} s (rank 0 serves it: is it started, with this address?)"
                )
            store = dist.TCPStore(host, int(port), fleet.world_size, is_master=serve, timeout=fleet.timeout)
            group = dist.ProcessGroupGloo(dist.PrefixStore("streamload/fleet/", store), fleet.rank, fleet.world_size,
                                          fleet.timeout)  # fmt: skip
    except StreamloadError:
        raise
    except Exception as exc:
        raise StreamloadError(
            f"joining the fleet at {fleet.address} as {me} failed (every member must join within {bound:.0f} s; "
            f"rank 0 serves the address): {exc}"
        ) from exc
    return store, group


def _listening(host: str, port: int, deadline: float) -> bool:
    """Whether something accepts connections at host:port before `deadline` (tried each second): a
    member waits for rank 0 here, in its own words, not in torch's store client's retries and traces."""
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return True
        except OSError:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(1.0, left))


# First word after this long, then every `_SAY_EVERY` seconds: a member started first waits in silence no
# longer than a user would before thinking it hung.
_SAY_AFTER, _SAY_EVERY = 5.0, 30.0


@contextmanager
def _saying_while(what: str, bound: float) -> Iterator[None]:
    """Logs `what` (with the seconds waited, of `bound`) while the block waits; the thread that says it
    ends with the block."""
    done = threading.Event()
    started = time.monotonic()

    def say() -> None:
        wait = _SAY_AFTER
        while not done.wait(wait):
            log.warning("streamload: %s (%.0f s of at most %.0f s)", what, time.monotonic() - started, bound)
            wait = _SAY_EVERY

    speaker = threading.Thread(target=say, name="streamload-fleet-wait", daemon=True)
    speaker.start()
    try:
        yield
    finally:
        done.set()
        speaker.join()
