"""Nodes that start together split a checkpoint: each loads with its own cache_dir and in-process seeder, and
`peers=` naming every node; each serves what it has verified while it still loads, and the store serves each
byte about once. On loopback: the store is tests/servers.py's RangeServer (counting the bytes it sends), the
nodes are loads in threads of this process (or a process of their own, where one is killed), each checked bit
for bit against safetensors' own."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest

import streamload
from streamload.format.header import TensorInfo
from streamload.integrity import blocks
from streamload.servers.seed import Seeder
from streamload.storage import peers, wave
from streamload.storage.cache import Copies, version_of
from streamload.storage.peer_proof import read_key
from streamload.storage.peers import url_path, version_tag
from streamload.storage.verified import CLAIMED, COPY, NODE, WAIT, Verified

from .servers import RangeServer
from .test_peers import _asked, assert_same, proved, publish_digests, warnings_of, write_shards

pytest.importorskip("obstore")

SEGMENT = 1 << 20  # a segment of the wave: one digest block (the default, 8 MiB, would make a file one segment)
BOUND = 90.0  # seconds any wave of loads here may take, whatever happens


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMLOAD_PEER_TIMEOUT", "3")  # a long poll waits 6 s (or the segment's time x 3)
    monkeypatch.setenv("STREAMLOAD_RETRIES", "2")
    monkeypatch.delenv("STREAMLOAD_PEERS_UNVERIFIED", raising=False)
    monkeypatch.setattr(blocks, "PIECE", SEGMENT)


@pytest.fixture(autouse=True)
def no_thread_left(store: Store) -> Iterator[None]:
    """Every thread a wave started (seeders, fetchers ahead, requests' deadlines, the peers' pools) ended
    with its load or seeder (the store's client loop, started with the store, goes on)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while (left := [t.name for t in threading.enumerate() if t.name.startswith("streamload") and t not in before]) \
            and time.monotonic() < deadline:  # fmt: skip
        time.sleep(0.05)
    assert not left, left


def _write(folder: Path) -> int:
    """Three shards of 8 MiB (tensors of one digest block each, a small one, an empty one); their tensor bytes."""
    return write_shards(folder, 7, (256, 1024), 8)


class Store:
    """The store: a RangeServer over `www/model` (digests published beside it) and `www/bare` (none)."""

    def __init__(self, www: Path) -> None:
        self.tensor_bytes = _write(www / "model")
        _write(www / "bare")
        self.www = www
        self.server = RangeServer(www, rate=16e6)  # a store capped per connection; peers on loopback are faster
        self.url = f"{self.server.url}/model/"
        self.bare = f"{self.server.url}/bare/"
        publish_digests(self.url, www / "model")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    made = Store(tmp_path_factory.mktemp("wave"))
    yield made
    made.server.close()


@contextmanager
def nodes(root: Path, n: int) -> Iterator[list[tuple[Path, Seeder]]]:
    """`n` nodes: each a cache directory of its own and a seeder serving it (port 0)."""
    made: list[tuple[Path, Seeder]] = []
    try:
        for k in range(n):
            cache = root / f"node{k}"
            cache.mkdir()
            made.append((cache, Seeder(cache, "127.0.0.1", 0).start()))
        yield made
    finally:
        for _, seeder in made:
            seeder.close()


def together(loads: list[Callable[[], object]]) -> list[object]:
    """Each of `loads` run in a thread of its own, all started at once; their results (or what each raised,
    raised here), within `BOUND` seconds."""
    results: list[object] = [None] * len(loads)
    errors: list[BaseException] = []
    start = threading.Barrier(len(loads))

    def run(k: int) -> None:
        start.wait()
        try:
            results[k] = loads[k]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(len(loads))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + BOUND
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"a load of the wave ran past {BOUND} s"
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """Honest waves on a busy machine: a node starved of the cores for seconds is no failing peer (its long polls
    may wait 30 s, the seeder's cap)."""
    monkeypatch.setenv("STREAMLOAD_PEER_TIMEOUT", "15")


def loads_of(store: Store, caches: list[Path], peers: list[str], url: str | None = None) -> list[Callable[[], object]]:
    return [lambda c=c: streamload.load(url or store.url, device="cpu", cache_dir=c, peers=peers) for c in caches]


def tensor_reads(server: RangeServer, first: int) -> int:
    """Bytes of tensors the store was asked for since its `first` request (every ranged GET but a header's read,
    which starts at byte 0)."""
    return sum(b - a for spans in _asked(server.requests[first:]).values() for a, b in spans if a > 0)


def kept_whole(cache: Path) -> int:
    """Complete copies (a record beside them) in `cache`."""
    return sum(1 for p in cache.rglob("*.safetensors") if Path(f"{p}.streamload.json").exists())


# -- a wave ----------------------------------------------------------------------------------------------
def test_three_nodes_that_start_together_split_what_the_store_serves(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture, patient: None
) -> None:
    first = len(store.server.requests)
    with nodes(tmp_path, 3) as made:
        urls = [seeder.url for _, seeder in made]
        got = together(loads_of(store, [cache for cache, _ in made], urls))
        for state in got:
            assert_same(state, store.www / "model")  # type: ignore[arg-type]
        served = tensor_reads(store.server, first)
        assert served <= 1.2 * store.tensor_bytes, (served, store.tensor_bytes)  # not 3x: each byte about once
        assert all(seeder.sent > 0 for _, seeder in made), [seeder.sent for _, seeder in made]  # each served some
        heads = [r for _, seeder in made for r in seeder.requests if r[0] == "HEAD"]
        assert len(heads) <= 2 * 3 * 3 * 3  # a HEAD a node, file and peer (its own seeder too), a few more at most
    assert not warnings_of(caplog)
    assert all(kept_whole(cache) == 3 for cache, _ in made)  # each node holds complete copies: it seeds them


def free_ports(n: int) -> list[int]:
    """`n` ports nothing listens at now (bound and let go: nodes named in `peers=` before their seeders start)."""
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    ports = [s.getsockname()[1] for s in sockets]
    for sock in sockets:
        sock.close()
    return ports


def test_a_node_whose_seeder_binds_a_moment_later_is_of_the_wave(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture, patient: None
) -> None:
    """Nodes started together bind their seeders at different moments: one whose seeder is not listening yet when
    the others first ask (connection refused) is asked again while the wave forms, not dropped (no warning): it
    joins, and the store serves each byte about once."""
    (late_port,) = free_ports(1)
    slow = RangeServer(store.www, rate=3e6)  # the wave's loads take seconds: the late seeder binds within them
    url = f"{slow.url}/model/"
    try:
        with nodes(tmp_path, 2) as made:
            urls = [seeder.url for _, seeder in made] + [f"http://127.0.0.1:{late_port}"]
            late_cache = tmp_path / "late"
            late_cache.mkdir()
            seeders: list[Seeder] = []

            def late() -> object:
                time.sleep(0.5)  # the others have asked it, and began their copies
                seeders.append(Seeder(late_cache, "127.0.0.1", late_port).start())
                return streamload.load(url, device="cpu", cache_dir=late_cache, peers=urls)

            try:
                got = together([*loads_of(store, [cache for cache, _ in made], urls, url), late])
            finally:
                for seeder in seeders:
                    seeder.close()
            for state in got:
                assert_same(state, store.www / "model")  # type: ignore[arg-type]
            served = tensor_reads(slow, 0)
    finally:
        slow.close()
    assert served <= 1.2 * store.tensor_bytes, (served, store.tensor_bytes)
    # not dropped at its first refusal (what it then owns depends on what the others had begun by then)
    assert seeders and not warnings_of(caplog), warnings_of(caplog)


def test_a_peer_that_never_binds_is_said_once_and_costs_nothing(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer nothing ever listens at, named beside two nodes of a wave: asked again while the wave forms, then
    dropped with one warning a load naming it; the loads exact, the store serving each byte about once."""
    monkeypatch.setattr(wave, "TOGETHER", 2.0)
    (down,) = free_ports(1)
    first = len(store.server.requests)
    with nodes(tmp_path, 2) as made:
        urls = [seeder.url for _, seeder in made] + [f"http://127.0.0.1:{down}"]
        got = together(loads_of(store, [cache for cache, _ in made], urls))
        for state in got:
            assert_same(state, store.www / "model")  # type: ignore[arg-type]
        assert tensor_reads(store.server, first) <= 1.2 * store.tensor_bytes
    named = [w for w in warnings_of(caplog) if f"127.0.0.1:{down}" in w]
    assert len(named) == 2 and all("nothing listened there" in w for w in named), warnings_of(caplog)
    assert len(warnings_of(caplog)) == 2


def test_a_node_that_joins_mid_wave_asks_the_owners(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, patient: None
) -> None:
    """A node that starts after the wave's nodes may join (`TOGETHER`) owns nothing: it asks the owners for what
    they verified (waiting for the rest), and the store serves it no tensor byte."""
    monkeypatch.setattr(wave, "TOGETHER", 0.5)
    slow = RangeServer(store.www, rate=0.5e6)  # the same objects, slower: a wave of seconds, the joiner's 1 s in it
    url = f"{slow.url}/model/"
    try:
        with nodes(tmp_path, 3) as made:
            urls = [seeder.url for _, seeder in made]
            ended: list[float] = []
            joined: list[float] = []

            def early(cache: Path) -> object:
                state = streamload.load(url, device="cpu", cache_dir=cache, peers=urls)
                ended.append(time.monotonic())
                return state

            def late() -> object:
                time.sleep(1.0)  # the two are mid-load
                joined.append(time.monotonic())
                return streamload.load(url, device="cpu", cache_dir=made[2][0], peers=urls)

            began = len(slow.requests)
            got = together([lambda: early(made[0][0]), lambda: early(made[1][0]), late])
            for state in got:
                assert_same(state, store.www / "model")  # type: ignore[arg-type]
            assert joined[0] < min(ended)  # it joined while they loaded
            served = tensor_reads(slow, began)
            assert served <= 1.2 * store.tensor_bytes, (served, store.tensor_bytes)  # the joiner's: from the nodes
            assert made[2][1].sent == 0  # it owned nothing: asked for nothing
    finally:
        slow.close()
    assert not warnings_of(caplog)


def test_a_node_whose_consumer_waits_still_serves_the_segments_it_owns(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture, patient: None
) -> None:
    """Node 0 takes its first tensor and then waits (its consumer busy elsewhere, its ring full): the segments it
    owns are read ahead of its pipeline all the same, so nodes 1 and 2 get them from it and finish while it waits."""
    first = len(store.server.requests)
    resume = threading.Event()
    with nodes(tmp_path, 3) as made:
        urls = [seeder.url for _, seeder in made]
        done: list[float] = []

        def waiting() -> object:
            out = {}
            with streamload.iter(store.url, device="cpu", cache_dir=made[0][0], peers=urls) as stream:
                for k, (name, t) in enumerate(stream):
                    out[name] = t
                    if k == 0:
                        assert resume.wait(BOUND)
            return out

        def other(cache: Path) -> object:
            state = streamload.load(store.url, device="cpu", cache_dir=cache, peers=urls)
            done.append(time.monotonic())
            return state

        def waker() -> bool:
            deadline = time.monotonic() + 20  # a long poll may wait 30 s: they would not be done by then
            while len(done) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            resume.set()
            return len(done) == 2

        got = together([waiting, lambda: other(made[1][0]), lambda: other(made[2][0]), waker])
        assert got[3] is True  # both finished while node 0 waited
        for state in got[:3]:
            assert_same(state, store.www / "model")  # type: ignore[arg-type]
        served = tensor_reads(store.server, first)
        assert served <= 1.2 * store.tensor_bytes, (served, store.tensor_bytes)
    assert not warnings_of(caplog)


class _Claims(threading.Thread):
    """A peer that says, of every file, that its node loads it since `since` (a HEAD with the file's tag), and
    answers every GET 404: a liar about its start."""

    def __init__(self, tags: dict[str, tuple[str, int]], since: str, claimed: str | None = None) -> None:
        import http.server

        claims = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _head(self, status: int) -> None:
                self.send_response(status)
                self.send_header(NODE, "evil")
                tag, size = tags.get(self.path, ("", 0))
                if status == 200:
                    self.send_header("ETag", tag)
                    self.send_header(COPY, f"loading; since={since}")
                    if claimed is not None:
                        self.send_header(CLAIMED, claimed)
                self.send_header("Content-Length", str(size if status == 200 else 0))
                self.end_headers()

            def do_HEAD(self) -> None:
                self._head(200 if self.path in tags else 404)

            def do_GET(self) -> None:
                claims.gets += 1
                self._head(404)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(daemon=True)
        self.gets = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def run(self) -> None:
        self.server.serve_forever(poll_interval=0.05)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.join(5)


@pytest.mark.parametrize("since", ["nan", "inf", "-inf", "9e18"])
def test_a_peer_that_says_its_load_began_at_no_real_time_is_not_of_the_wave(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture, since: str, patient: None
) -> None:
    """A start that is not a time (nan compares false with every other, so a wave counting it would have no
    member; infinities; one far in the future) is no start: the peer is no member, the honest nodes split the
    files between them and the store serves each byte about once."""
    _, made, served = beside_a_liar(store, tmp_path, since)
    assert served <= 1.2 * store.tensor_bytes, (served, store.tensor_bytes)
    assert all(seeder.sent > 0 for _, seeder in made)


def beside_a_liar(store: Store, tmp_path: Path, since: str, claimed: str | None = None
                  ) -> tuple[_Claims, list[tuple[Path, Seeder]], int]:  # fmt: skip
    """Two honest nodes load together beside a `_Claims` liar, every tensor exact: the liar, the nodes (their
    seeders closed) and the tensor bytes the store served them."""
    checkpoint = streamload.inspect(store.url)
    tags = {url_path(h.path): (version_tag(version_of(h)), h.size) for h in checkpoint.files}
    liar = _Claims(tags, since, claimed)
    liar.start()
    first = len(store.server.requests)
    try:
        with nodes(tmp_path, 2) as made:
            urls = [liar.url, *(seeder.url for _, seeder in made)]
            got = together(loads_of(store, [cache for cache, _ in made], urls))
            for state in got:
                assert_same(state, store.www / "model")  # type: ignore[arg-type]
            return liar, made, tensor_reads(store.server, first)
    finally:
        liar.close()


def test_what_a_peer_claims_is_read_as_ranges_or_not_at_all() -> None:
    from streamload.storage.verified import claims

    assert claims("0-5,5-9,20-30") == [(0, 9), (20, 30)]
    for said in ["", None, "0-5,garbage", "9-3", "-1-50", "5-5", "0-5;6-7", "1e3-2e3", "\u00b2-3", "0-\u0663",
                 "0" * 5000 + "1-2", "1-" + "9" * 5000]:  # fmt: skip
        assert claims(said) == [], said
    assert claims(",".join([f"{2 * k}-{2 * k + 1}" for k in range(5000)])) == [(2 * k, 2 * k + 1) for k in range(1024)]


@pytest.mark.parametrize("claimed", ["0-99999999999", "\u00b2-3"])
def test_a_peer_that_claims_what_it_never_verifies_costs_a_request_a_file(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture, claimed: str, patient: None
) -> None:
    """A node of the wave that says it has verified or is reading every byte (or says so in a malformed way),
    then serves nothing: asked for its segments, it answers 404 and is asked no more for that file; the honest
    nodes split the rest, exact. The store serves what both asked the liar for at once twice (as with a liar
    that claims nothing), never the whole checkpoint to each."""
    liar, _, served = beside_a_liar(store, tmp_path, f"{time.time():.3f}", claimed)
    assert served <= 1.5 * store.tensor_bytes, (served, store.tensor_bytes)
    # the requests in flight to it when its first 404 came, a file and node, not one a segment
    assert liar.gets <= peers.REQUESTS * len(streamload.inspect(store.url).files) * 2, liar.gets
    assert all(liar.url in w for w in warnings_of(caplog)), warnings_of(caplog)


def test_an_owner_whose_requests_all_long_poll_is_waited_for_as_long_as_they_may(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An owner with every request slot held by long polls (each may wait as long as a segment's three reads
    from the store) is waited for that long, not the default poll's: its segment is then asked of it, not read
    from the store again; with no long poll to wait out, the wait stays the timeout and a default poll."""
    monkeypatch.setenv("STREAMLOAD_PEER_TIMEOUT", "0.2")  # a default long poll: 0.4 s
    (peer,) = peers.resolve(["http://127.0.0.1:9"])
    swarm = peers.Swarm([peer], {})
    try:
        swarm._state[peer].inflight = peers.REQUESTS

        def one_ends() -> None:
            time.sleep(0.9)
            with swarm._lock:
                swarm._state[peer].inflight -= 1
                swarm._lock.notify_all()

        ending = threading.Thread(target=one_ends)
        ending.start()
        assert swarm._take(peer, 2.0)  # its polls may last 2 s: the slot freed at 0.9 s is this request's
        ending.join()
        began = time.monotonic()
        assert not swarm._take(peer, 0.0)
        assert time.monotonic() - began < 1.2
    finally:
        swarm.close()


def test_a_request_that_waited_for_an_owner_counted_out_meanwhile_is_not_sent_to_it(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request waiting for a free slot of the segment's owner, which another request's 404 counts out of the
    file's wave meanwhile: the slot it then gets is given back, and the segment is this node's (the other
    owner left), not another long poll at the node that just said it had not verified it."""
    monkeypatch.setenv("STREAMLOAD_PEER_TIMEOUT", "2")
    header = streamload.inspect(store.url).files[0]
    (other,) = peers.resolve(["http://127.0.0.1:9"])
    swarm = peers.Swarm([other], {header.path: header}, node="me")
    try:
        tag = swarm._tags[header.path]
        start = next(s for s in range(0, 64 << 20, SEGMENT) if wave.owner(["them", "me"], tag, s) == "them")
        swarm._known[header.path] = wave.Known(members={"them": wave.Member(other, time.time(), ())}, since=time.time())
        swarm._state[other].inflight = peers.REQUESTS  # its slots all held by long polls
        got: list[object] = []
        asking = threading.Thread(target=lambda: got.append(swarm.owner(header.path, start, set(), 5.0)))
        asking.start()
        time.sleep(0.3)
        swarm._failed(other, header.path, peers._Failed("had not verified bytes in time (404)", drop=False))
        swarm._release(other)  # that request ends
        asking.join(10)
        assert got == [None] and swarm._state[other].inflight == peers.REQUESTS - 1
    finally:
        swarm.close()


def test_a_segment_a_peer_waits_for_is_read_ahead_by_its_owner_by_rendezvous(tmp_path: Path) -> None:
    """A peer that had not seen another node's claim asks the segment's owner by rendezvous: that node reads it
    ahead (from where it knows it is: the claimer) so that the long poll is answered, though by what it knows
    it does not own it; a segment asked of a node that owns it neither way is left to its pipeline."""
    units = blocks.Units([blocks.Unit(k * SEGMENT, (k + 1) * SEGMENT, "d", f"block {k}") for k in range(4)])
    segments = wave.Segments(units)
    assert len(segments.all) == 4
    fd = os.open(tmp_path / "copy", os.O_RDWR | os.O_CREAT)
    verified = Verified(None, fd)  # type: ignore[arg-type]  (the header is only carried)
    read: list[int] = []

    def fetch(path: object, segment: tuple[int, int, int, int]) -> None:
        read.append(segment[0])
        verified.mark(segment[0], segment[1])

    path = Path("model.safetensors")
    ahead = wave.Ahead([(path, segments, verified)], lambda p, at, surely: False, fetch, lambda: 0,
                       lambda p, at: at == 2 * SEGMENT)  # fmt: skip
    try:
        verified.want(1 * SEGMENT, 2 * SEGMENT)
        verified.want(2 * SEGMENT, 3 * SEGMENT)
        deadline = time.monotonic() + 5
        while not read and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(wave.IDLE * 2)  # what else it would read, it has read by now
        assert read == [2 * SEGMENT]
    finally:
        ahead.close()
        os.close(fd)


# -- engines' start-up fetches (prefetch.py `seed`) -----------------------------------------------------
def test_fetches_that_seed_from_their_start_split_what_the_store_serves(
    store: Store, tmp_path: Path, patient: None
) -> None:
    """Three fetches of the kind an engine starts (a process each, `seed` and `peers` naming all three), begun a
    few tenths of a second apart: each seeds its cache directory from its start (reporting where), the store
    serves each byte about once, every copy exact; once fetched they serve on, until stopped."""
    from streamload.integrations.startup import prefetch

    ports = free_ports(3)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    slow = RangeServer(store.www, rate=1e6)
    url = f"{slow.url}/model/"
    fetches: list[prefetch.Prefetch] = []
    try:
        for k, port in enumerate(ports):
            fetches.append(prefetch.start(url, tmp_path / f"done{k}.json", tmp_path / f"node{k}", peers=urls,
                                          seed={"host": "127.0.0.1", "port": port}))  # fmt: skip
            time.sleep(0.3)
        assert [f.seeding for f in fetches] == urls
        reports = [prefetch.wait(f.done, f.pid, timeout=BOUND) for f in fetches]
        assert all(r["ok"] and not r["not_cached"] for r in reports), reports
        served = tensor_reads(slow, 0)
        assert served <= 1.2 * store.tensor_bytes, (served, store.tensor_bytes)  # not 3x
        # what the first claimed before the others asked is its own (it reads everything at once here): the
        # later ones read it from its copy in progress
        assert sum(r["from_source"] for r in reports) <= 1.2 * store.tensor_bytes, reports
        assert all(r["from_peers"] + r["from_source"] == r["bytes"] for r in reports), reports
        assert reports[1]["from_peers"] > 0 and reports[2]["from_peers"] > 0, reports
        for k in range(3):
            assert_same(streamload.load(url, device="cpu", cache_dir=tmp_path / f"node{k}"), store.www / "model")
        assert tensor_reads(slow, 0) == served  # complete copies: read from the cache alone
        late = streamload.load(url, device="cpu", cache_dir=tmp_path / "late", peers=urls)  # they serve on
        assert_same(late, store.www / "model")
        assert tensor_reads(slow, 0) == served
    finally:
        for fetching in fetches:
            fetching.stop()
        slow.close()
    assert not any(prefetch._alive(f.pid) for f in fetches)


# -- nodes that fail --------------------------------------------------------------------------------------
NODE_SCRIPT = """
import sys
import streamload
from streamload.format.header import TensorInfo
from streamload.integrity import blocks
from streamload.servers.seed import Seeder

blocks.PIECE = int(sys.argv[3])
seeder = Seeder(sys.argv[2], "127.0.0.1", 0).start()
print(seeder.url, flush=True)
peers = sys.stdin.readline().split()
with streamload.iter(sys.argv[1], device="cpu", cache_dir=sys.argv[2], peers=peers, slots=2) as stream:
    for name, _ in stream:
        print(name, flush=True)
"""


def line_of(stream: IO[str], seconds: float = 60.0) -> str:
    """The next line a process prints, within `seconds` ("" where none came)."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(seconds)
    return got[0].strip() if got else ""


def test_a_node_killed_mid_wave_and_the_others_exact(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node of its own process, mid-load (a member of the wave: the others ask it for its segments), killed:
    each of the others drops it (one warning) and reads its segments elsewhere, exact."""
    slow = RangeServer(store.www, rate=2e6)  # the same objects, slower: a wave of seconds
    url = f"{slow.url}/model/"
    (tmp_path / "killed").mkdir()
    node = subprocess.Popen(
        [sys.executable, "-c", NODE_SCRIPT, url, str(tmp_path / "killed"), str(SEGMENT)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert node.stdin is not None and node.stdout is not None
        killed = line_of(node.stdout)
        assert killed.startswith("http://"), killed
        with nodes(tmp_path, 2) as made:
            urls = [killed, *(seeder.url for _, seeder in made)]
            node.stdin.write(" ".join(urls) + "\n")
            node.stdin.flush()
            assert line_of(node.stdout)  # its first tensor: it loads (its copies in progress)

            def kill() -> None:
                time.sleep(0.5)  # the others ask it meanwhile
                os.kill(node.pid, signal.SIGKILL)

            got = together([*loads_of(store, [cache for cache, _ in made], urls, url), kill])
            for state in got[:2]:
                assert_same(state, store.www / "model")  # type: ignore[arg-type]
    finally:
        node.kill()
        node.wait()
        for stream in (node.stdin, node.stdout):
            if stream is not None:
                stream.close()
        slow.close()
    named = [w for w in warnings_of(caplog) if killed in w]
    assert 1 <= len(named) <= 2 and all("dropped" in w for w in named), named  # at most one a load


def test_a_node_whose_copy_changes_after_it_verified_it_is_dropped(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The liar's partial copy has a byte flipped at the start of every range as soon as it is marked verified
    (a disk that rots, or someone who writes into it): the others find it by the digests, drop it (one warning
    each, naming it), and are exact."""
    liar_cache = tmp_path / "node0"
    mark = Verified.mark

    def lying(self: Verified, start: int, end: int) -> None:
        mark(self, start, end)
        fd = self.open()
        if fd is None:
            return
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(liar_cache)):
                os.pwrite(fd, bytes([os.pread(fd, 1, start)[0] ^ 0xFF]), start)
        finally:
            os.close(fd)

    monkeypatch.setattr(Verified, "mark", lying)
    with nodes(tmp_path, 3) as made:
        urls = [seeder.url for _, seeder in made]
        got = together(loads_of(store, [cache for cache, _ in made], urls))
        for state in got:  # the honest nodes, and the liar's own load: what it reads back of its copy is checked
            assert_same(state, store.www / "model")  # type: ignore[arg-type]
        liar = made[0][1]
        assert [r for r in liar.requests if r[0] == "GET" and r[2] == 206]  # it was asked, and answered
    named = [w for w in warnings_of(caplog) if liar.url in w]
    dropped = [w for w in named if "do not match the source's digests" in w and "dropped" in w]
    # Each honest load drops it once where it sent a rotten byte; a load may instead find it serving nothing more
    # (its own load saw its copy change and gave it up: what it owned is then 404, said once a file)
    assert dropped and len(dropped) <= 2 and all(w in dropped or "had not verified" in w for w in named), named
    own = [w for w in warnings_of(caplog) if "own copy in the cache changed" in w]
    assert len(own) == len({w.split(":")[1] for w in own}) <= 3, own  # the liar's load: once a file at most


def test_a_node_that_never_verifies_what_it_owns_costs_a_wait_not_the_load(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that says it loads every file (its copies in progress) but verifies nothing: each request to it
    waits its long poll and gets 404; the others stop asking it for that file (one warning each, naming it),
    own its segments between them, and are exact, within a few waits."""
    monkeypatch.setenv("STREAMLOAD_PEER_TIMEOUT", "1")  # a long poll: 2 s
    checkpoint = streamload.inspect(store.url)
    with nodes(tmp_path, 3) as made:
        stalled = Copies(made[0][0], {h.path: h for h in checkpoint.files}, ())  # a load that never reads
        try:
            urls = [seeder.url for _, seeder in made]
            began = time.monotonic()
            got = together(loads_of(store, [cache for cache, _ in made[1:]], urls))
            took = time.monotonic() - began
            for state in got:
                assert_same(state, store.www / "model")  # type: ignore[arg-type]
            stalls = [r for r in made[0][1].requests if r[0] == "GET"]
            assert stalls and all(r[2] == 404 for r in stalls)  # asked, and never a byte
        finally:
            stalled.close()
    assert took < 3 * 2 * 2 + 10, took  # a wait of 2 s (twice the timeout) a file, at most
    named = [w for w in warnings_of(caplog) if made[0][1].url in w]
    assert len(named) == 2 and all("had not verified" in w for w in named), named


def test_without_digests_no_wave_each_node_reads_the_store(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = len(store.server.requests)
    with nodes(tmp_path, 3) as made:
        urls = [seeder.url for _, seeder in made]
        got = together(loads_of(store, [cache for cache, _ in made], urls, store.bare))
        for state in got:
            assert_same(state, store.www / "bare")  # type: ignore[arg-type]
        assert all(seeder.requests == [] for _, seeder in made)  # not even asked
    assert tensor_reads(store.server, first) >= 3 * store.tensor_bytes  # each node, the whole checkpoint
    said = warnings_of(caplog)
    assert len(said) == 3 and all("peers are not used for any file" in w for w in said), said


# -- what a node serves of a copy in progress ------------------------------------------------------------
def _ask(url: str, path: str, key: bytes | None, headers: dict[str, str], method: str = "GET"
         ) -> tuple[int, dict[str, str], bytes, float]:  # fmt: skip
    host, port = url.split("://")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    began = time.monotonic()
    try:
        conn.request(method, path, headers=proved(key, method, path, headers) if key else headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read(), time.monotonic() - began
    finally:
        conn.close()


def test_a_node_serves_only_what_it_verified(store: Store, tmp_path: Path) -> None:
    """A copy being written (a load's `Copies`): a range written unchecked (even written again as checked), or
    not written, gets no body (404, at once, or after the wait the request allows); a checked one its bytes; a
    range checked while a request waits, its bytes then. The proof and the version tag apply as for complete
    copies; once the writer is gone, nothing of it is served."""
    header = streamload.inspect(store.url).files[0]
    raw = (store.www / "model" / header.path.name).read_bytes()
    tag = version_tag(version_of(header))
    key = read_key(header.prefix, tag, None)
    path = url_path(header.path)
    one, two, three = sorted((t for t in header.tensors if t.nbytes), key=lambda t: t.begin)[:3]

    def ranged(t: TensorInfo, wait: str = "", end: int | None = None) -> dict[str, str]:
        asked = {"Range": f"bytes={t.begin}-{(t.end if end is None else end) - 1}", "If-Match": tag}
        return {**asked, WAIT: wait} if wait else asked

    with nodes(tmp_path, 1) as ((cache, seeder),):
        copies = Copies(cache, {header.path: header}, ())
        try:
            copies.write(header.path, one.begin, memoryview(raw[one.begin : one.end]))  # unchecked
            copies.write(header.path, one.begin, memoryview(raw[one.begin : one.end]), checked=True)  # on disk already
            status, said, body, _ = _ask(seeder.url, path, key, {}, "HEAD")
            assert (status, said[NODE], said["ETag"], body) == (200, seeder.node, tag, b"")
            assert said[COPY].startswith("loading; since=")
            assert _ask(seeder.url, path, key, ranged(one))[:3:2] == (404, b"")  # no wait asked: at once
            status, said, body, took = _ask(seeder.url, path, key, ranged(one, "0.5"))
            assert (status, body, said[NODE]) == (404, b"", seeder.node) and took >= 0.45
            copies.write(header.path, two.begin, memoryview(raw[two.begin : two.end]), checked=True)
            status, said, body, _ = _ask(seeder.url, path, key, ranged(two))
            assert (status, body) == (206, raw[two.begin : two.end])
            assert said["Content-Range"] == f"bytes {two.begin}-{two.end - 1}/{len(raw)}"
            assert _ask(seeder.url, path, key, ranged(two, "0.2", two.end + 1))[:3:2] == (404, b"")  # a byte past it
            assert _ask(seeder.url, path, key, ranged(three, "0.2"))[:3:2] == (404, b"")  # not written
            assert _ask(seeder.url, path, None, ranged(two))[0] == 403  # no proof
            assert _ask(seeder.url, path, key, {**ranged(two), "If-Match": '"another"'})[0] == 412
            waited: list[tuple[int, dict[str, str], bytes, float]] = []
            waiter = threading.Thread(target=lambda: waited.append(_ask(seeder.url, path, key, ranged(three, "5"))))
            waiter.start()
            time.sleep(0.3)
            copies.write(header.path, three.begin, memoryview(raw[three.begin : three.end]), checked=True)
            waiter.join(10)
            assert waited and waited[0][:3:2] == (206, raw[three.begin : three.end]) and waited[0][3] < 4
        finally:
            copies.close()
        assert _ask(seeder.url, path, key, ranged(two))[:3:2] == (404, b"")  # the writer gone: nothing of it


def test_bytes_written_over_verified_ones_never_replace_them(store: Store, tmp_path: Path) -> None:
    """An unchecked write that overlaps a verified range in part (a source read cut at other bounds) writes only
    the bytes not yet on disk: the verified ones stay as checked, and so does what is served and read back."""
    header = streamload.inspect(store.url).files[0]
    raw = (store.www / "model" / header.path.name).read_bytes()
    start = min(t.begin for t in header.tensors if t.nbytes)
    copies = Copies(tmp_path, {header.path: header}, ())
    try:
        copies.write(header.path, start, memoryview(raw[start : start + 1000]), checked=True)
        copies.write(header.path, start + 500, memoryview(bytes(1000)))  # unchecked, and not the file's bytes
        kept = copies.read_verified(header.path, start, start + 1000)
        assert kept is not None and bytes(kept) == raw[start : start + 1000]
        assert copies.read_verified(header.path, start, start + 1001) is None  # past it: written, never verified
    finally:
        copies.close()


def test_a_copy_in_progress_with_a_second_link_is_not_served(store: Store, tmp_path: Path) -> None:
    """A hard link made to the writer's own file (by someone who could write the folder) makes it another's file
    too: its verified bytes are no longer served (404), as a complete copy with two links is not."""
    header = streamload.inspect(store.url).files[0]
    raw = (store.www / "model" / header.path.name).read_bytes()
    tag = version_tag(version_of(header))
    key = read_key(header.prefix, tag, None)
    path = url_path(header.path)
    t = min((t for t in header.tensors if t.nbytes), key=lambda t: t.begin)
    asked = {"Range": f"bytes={t.begin}-{t.end - 1}", "If-Match": tag}
    with nodes(tmp_path, 1) as ((cache, seeder),):
        copies = Copies(cache, {header.path: header}, ())
        try:
            copies.write(header.path, t.begin, memoryview(raw[t.begin : t.end]), checked=True)
            assert _ask(seeder.url, path, key, asked)[:3:2] == (206, raw[t.begin : t.end])
            (partial,) = [p for p in cache.rglob(f"{header.path.name}.partial.*") if not p.name.endswith(".record")]
            os.link(partial, tmp_path / "planted")
            assert _ask(seeder.url, path, key, asked)[:3:2] == (404, b"")
        finally:
            copies.close()
