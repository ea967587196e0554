"""The control plane's I/O: messages on Redis streams, fail-open.

Ranks, per-node agents and the controller all talk through this one thin layer. A
training step must never stall or crash because the control plane is sick, so no
call here raises for anything Redis or the network does: :meth:`Bus.post` answers
False, :meth:`Bus.read` answers ``[]``, :meth:`Bus.alive` answers None. A dead server
costs at most one socket timeout per call (redis-py's own retries are switched off),
and once a call has failed the Bus stops trying for a backoff interval (0.2 s doubling
to 2 s) and answers at once, so a rank polling every iteration does not pay a timeout
every iteration. What does raise is a programming error on this side: posting
something that is not a message (:class:`MessageError`), a bad name, a bad ``seek``.

Everything read is untrusted: an entry that is not exactly one field ``m`` holding a
valid message (see :mod:`falconext.protocol.codec`) is dropped, counted in
``dropped`` and described in ``errors``; the entries around it still arrive.

Where a reader starts. XREAD's ``$`` means "after whatever is last when this call
runs", so a reader that posts a command and then reads the replies would lose any
reply that landed before its first read. Instead each Bus asks the server's clock at
first contact and, for every stream it has not been told otherwise about (:meth:`seek`),
delivers exactly the entries posted from that moment on; Redis stream ids are
server-clock milliseconds, so this needs no per-stream round trip. After each read the
Bus remembers the last id it saw per stream.

Surviving a restart. The job's Redis keeps nothing on disk, so a restarted server has
empty streams, and if its clock stood behind the ids this Bus has seen, new entries
would get smaller ids and a reader would skip them for good. The Bus notices every new
connection, compares the server's ``run_id``, and on a new server moves back to ``0-0``
every position that lies beyond what that server's stream holds (and the start point,
if it lies beyond the server's clock). On a server restored from disk those positions
are still valid and are kept.

One Bus per thread: a Bus keeps positions and connection state without locks.
"""

from __future__ import annotations

import logging
import re
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any

import redis

from falconext.protocol import codec
from falconext.protocol.base import MessageError
from falconext.control.redis_client import redis_client

log = logging.getLogger(__name__)

FIELD = "m"
BACKOFF_START_S = 0.2
BACKOFF_MAX_S = 2.0
ERRORS_KEPT = 100
MAX_SEQ = 2**64 - 1

_ID = re.compile(r"^(\d+)-(\d+)$")
#: the ``@N`` that names node N's copy of a stream every node has
_NODE_COPY = re.compile(r"@\d+$")
# Connection-level trouble: server gone, unreachable, too slow, not (yet) accepting us.
_DOWN = (redis.ConnectionError, redis.TimeoutError, OSError)

StreamId = tuple[int, int]


class Bus:
    """Post and read control-plane messages on the Redis streams of one job."""

    def __init__(
        self,
        url: str,
        job: str,
        *,
        socket_timeout_s: float = 0.5,
        on_state: Callable[[bool, str], None] | None = None,
        maxlen: int = 10000,
        since_ms: int | None = None,
        tag: str | None = None,
    ) -> None:
        if not job or ":" in job or any(ch.isspace() for ch in job):
            raise ValueError(f"job name {job!r} must be non-empty, without ':' or whitespace (it namespaces the keys)")
        if socket_timeout_s <= 0:
            raise ValueError(f"socket_timeout_s must be positive, got {socket_timeout_s}")
        if maxlen < 1:
            raise ValueError(f"maxlen must be at least 1, got {maxlen}")
        self.url = url
        self.job = job
        #: one shard of a Redis Cluster: every key carries hash tag ``{tag}`` (a slot the
        #: shard serves; :mod:`falconext.control.shards`)
        self.tag = tag
        self.prefix = f"falcon:{job}:" if tag is None else f"falcon:{{{tag}}}:{job}:"
        self.socket_timeout_s = socket_timeout_s
        self.maxlen = maxlen
        self.on_state = on_state
        self.connected = True
        self.dropped = 0
        self.errors: deque[str] = deque(maxlen=ERRORS_KEPT)
        self._positions: dict[str, StreamId] = {}  # per stream name: the last id delivered
        #: entries a read put aside undecoded (``later``): (when, stream, entry id, text), oldest first
        self._later: deque[tuple[float, str, str, Any]] = deque()
        # for streams without a position: from the server clock, or ``since_ms`` (entries
        # posted from that time on, milliseconds since the epoch)
        self._start: StreamId | None = None if since_ms is None else (max(0, int(since_ms)), 0)
        self._run_id: str | None = None
        self._new_connection = True  # set by every (re)connect; the server may have changed
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._client = self._make_client(socket_timeout_s)
        self._blocking: tuple[int, redis.Redis] | None = None  # (block_ms, client) for XREAD BLOCK
        self.ping()  # fix the start point now, not at the first read

    # --- public API ---------------------------------------------------------------------

    def key(self, name: str) -> str:
        """The Redis key of a stream or liveness name in this job's namespace. A name
        ``base@N`` (node N's copy of a stream every node has, such as ``ctl@3``) is
        ``base`` here: on one server all nodes share it (on a cluster each shard has its
        own, :class:`~falconext.control.shards.ShardedBus`)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"stream/key name must be a non-empty string, got {name!r}")
        return self.prefix + _NODE_COPY.sub("", name)

    def post(self, stream: str, msg: Any) -> bool:
        """Append one message; False when Redis is unreachable or refuses it."""
        return self.post_text(stream, bus_text(msg))

    def post_text(self, stream: str, data: str) -> bool:
        """Append one message encoded already (:func:`bus_text`); False when Redis is
        unreachable or refuses it."""
        return self.post_raw(stream, {FIELD: data}) is not None

    def post_many(self, stream: str, msgs: list[Any]) -> bool:
        """Append several messages in one round trip (MessageError, before any is posted,
        when one is over the cap); False when Redis is unreachable or refuses any."""
        return self.post_texts(stream, [bus_text(m) for m in msgs])

    def post_texts(self, stream: str, datas: list[str]) -> bool:
        """Append several messages encoded already, in order, in one round trip (a
        100k-rank validation plan's 179 shares took a round trip each); False when Redis
        is unreachable or refuses any."""
        if not datas:
            return True
        key = self.key(stream)

        def send() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for data in datas:
                pipe.xadd(key, {FIELD: data}, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]
            return pipe.execute(raise_on_error=False)

        got = self._call(f"post to {stream}", send, None)
        return got is not None and not any(isinstance(x, Exception) for x in got)

    def post_raw(self, stream: str, fields: dict[str, str | bytes]) -> str | None:
        """Append an entry of arbitrary fields, unchecked (tests inject corrupted entries
        with this); returns its id, or None when Redis is unreachable or refuses."""
        key = self.key(stream)
        entry_id = self._call(
            f"post to {stream}",
            lambda: self._client.xadd(key, fields, maxlen=self.maxlen, approximate=True),  # type: ignore[arg-type]
            None,
        )
        return _text(entry_id) if entry_id is not None else None

    def read(
        self, streams: list[str], block_ms: int = 0, accept: set[str] | None = None, count: int | None = None,
        later: Callable[[Any], bool] | None = None,
    ) -> list[tuple[str, Any]]:
        """New messages on ``streams`` as ``(stream, message)`` in stream order, at most
        ``count`` per stream (None: all there are). An entry whose text ``later`` holds
        true of is put aside undecoded, in order, for :meth:`take_later` (a reader
        with more urgent messages behind it: the controller's fail-slow reports while
        it localizes).

        ``block_ms > 0`` waits up to that long for the first message (0 does not wait;
        it never means "forever" as in XREAD). While Redis is unreachable this returns
        ``[]``, after at most ``block_ms`` plus one socket timeout; in backoff it waits
        out ``block_ms`` anyway, so a consumer's poll loop does not spin.
        """
        out: list[tuple[str, Any]] = []
        self._read(streams, block_ms, count, lambda reply, keys: self._deliver(reply, keys, accept, out, later))
        return out

    @property
    def deferred(self) -> int:
        """Entries put aside by reads (``later``) and not taken yet."""
        return len(self._later)

    def deferred_since(self) -> float | None:
        """When (monotonic) the oldest entry put aside was read; None: none is."""
        return self._later[0][0] if self._later else None

    def take_later(self, most: int) -> list[tuple[str, Any]]:
        """Up to ``most`` of the entries put aside, oldest first, decoded as :meth:`read`
        decodes (a malformed one is dropped and counted)."""
        out: list[tuple[str, Any]] = []
        for _ in range(min(most, len(self._later))):
            _, stream, eid, raw = self._later.popleft()
            self._decode_into(stream, eid, raw, None, out)
        return out

    def read_raw(self, streams: list[str], block_ms: int = 0, count: int | None = None) -> list[tuple[str, str, bytes]]:
        """New entries on ``streams`` as :meth:`read` reads them, not decoded: ``(stream,
        entry id, message text)`` (for a reader that decodes many at once:
        :func:`~falconext.protocol.codec.decode_heartbeats`). An entry without exactly the
        message field is dropped and counted, as :meth:`read` drops it."""
        out: list[tuple[str, str, bytes]] = []
        self._read(streams, block_ms, count, lambda reply, keys: self._deliver_raw(reply, keys, out))
        return out

    def _read(self, streams: list[str], block_ms: int, count: int | None, deliver: Callable[[Any, dict[str, str]], None]) -> None:
        """The reading :meth:`read` promises; each reply handed to ``deliver(reply, keys)``."""
        if block_ms < 0:
            raise ValueError(f"block_ms must be >= 0, got {block_ms}")
        if count is not None and count < 1:
            raise ValueError(f"count must be >= 1 or None, got {count}")
        keys = {self.key(s): s for s in streams}
        if not keys:
            return
        deadline = time.monotonic() + block_ms / 1000
        if not self._ready():
            time.sleep(max(0.0, min(deadline, self._retry_at) - time.monotonic()))
            if not self._ready():
                return
        left_ms = min(block_ms, int((deadline - time.monotonic()) * 1000))  # less only after a backoff wait
        reply = self._call(f"read {','.join(streams)}", lambda: self._xread(keys, max(1, left_ms), block_ms, count), None)
        if reply is None:
            return
        deliver(reply, keys)
        if self._new_connection:
            # The read itself reconnected, maybe to a restarted server whose ids lie
            # behind our positions: check now, and read again if positions moved back.
            before = (dict(self._positions), self._start)
            moved = self._call("check server", self._check_server, False, check=False)
            if moved and (dict(self._positions), self._start) != before:
                reply = self._call(f"read {','.join(streams)}", lambda: self._xread(keys, 0, 0, count), None)
                if reply is not None:
                    deliver(reply, keys)

    def trim_read(self, stream: str) -> bool:
        """Remove from ``stream`` every entry up to the last this Bus has read (for a stream
        with this one reader: the controller's ``beats``), so the stream holds only the
        backlog; False when Redis is unreachable or refuses, or nothing was read yet."""
        pos = self._positions.get(stream)
        if pos is None:
            return False
        key = self.key(stream)
        first = _format_id((pos[0], pos[1] + 1) if pos[1] < MAX_SEQ else (pos[0] + 1, 0))
        return self._call(f"trim {stream}", lambda: self._client.xtrim(key, minid=first, approximate=False), None) is not None

    def seek(self, stream: str, last_id: str) -> None:
        """Make the next read of ``stream`` deliver the entries after ``last_id``
        (``"0-0"``: everything the stream still holds)."""
        self.key(stream)
        self._positions[stream] = _parse_id(last_id)

    def position(self, stream: str) -> str | None:
        """The id after which the next read of ``stream`` starts; None before first contact."""
        pos = self._positions.get(stream, self._start)
        return None if pos is None else _format_id(pos)

    def ping(self) -> bool:
        """True when Redis answered PING now; False when it is down or refused (never raises)."""
        return bool(self._call("ping", self._client.ping, False))

    def beat(self, name: str, ttl_s: float) -> bool:
        """Say "I am alive" for ``ttl_s`` seconds (the value is the sender's wall clock)."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        key = self.key(name)
        px = max(1, round(ttl_s * 1000))
        return bool(self._call(f"beat {name}", lambda: self._client.set(key, f"{time.time():.3f}", px=px), False))

    def put(self, name: str, value: str, ttl_s: float) -> bool:
        """Set key ``name`` to ``value`` for ``ttl_s`` seconds (a status snapshot, an
        operator's reply); False when Redis is unreachable or refuses."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        key = self.key(name)
        px = max(1, round(ttl_s * 1000))
        return bool(self._call(f"put {name}", lambda: self._client.set(key, value, px=px), False))

    def get(self, name: str) -> str | None:
        """Key ``name``'s value; None when it is not set or Redis cannot say."""
        key = self.key(name)
        value = self._call(f"get {name}", lambda: self._client.get(key), None)
        return None if value is None else _text(value)

    def alive(self, name: str) -> bool | None:
        """Whether ``name``'s last beat is still within its TTL; None when Redis cannot say."""
        key = self.key(name)
        found = self._call(f"alive {name}", lambda: self._client.exists(key), None)
        return None if found is None else bool(found)

    def names(self, prefix: str, most: int = 1000) -> list[str] | None:
        """The names (without the job's namespace) of the live keys that start with
        ``prefix`` (for example ``spare:``), at most ``most``; None when Redis cannot say."""
        pattern = self.key(prefix) + "*"

        def scan() -> list[str]:
            found = []
            for key in self._client.scan_iter(match=pattern, count=100):
                found.append(_text(key)[len(self.prefix):])
                if len(found) >= most:
                    break
            return found

        return self._call(f"names {prefix}", scan, None)

    def close(self) -> None:
        """Close both connections (the shared and the blocking one); never raises, safe to call twice."""
        for client in (self._client, self._blocking[1] if self._blocking else None):
            if client is not None:
                try:
                    client.close()
                except Exception:  # noqa: BLE001 - closing a dead connection must not raise
                    pass
        self._blocking = None

    def __enter__(self) -> Bus:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- connection state ---------------------------------------------------------------

    def _make_client(self, socket_timeout_s: float) -> redis.Redis:
        ref = weakref.ref(self)

        def on_connect(conn: Any) -> None:
            conn.on_connect()  # the handshake (AUTH, SELECT) redis-py would have done
            bus = ref()
            if bus is not None:
                bus._new_connection = True

        # No retries: a dead server costs one timeout per call, and the Bus's own
        # backoff decides when to try again.
        return redis_client(self.url, socket_timeout_s, self.socket_timeout_s, on_connect)

    def _ready(self) -> bool:
        return self.connected or time.monotonic() >= self._retry_at

    def _call(self, what: str, fn: Callable[[], Any], failed: Any, *, check: bool = True) -> Any:
        """Run one Redis operation fail-open and keep the connection state."""
        if not self._ready():
            return failed
        try:
            if check and self._new_connection:
                self._check_server()
            result = fn()
        except _DOWN as exc:
            self._down(f"{what}: {type(exc).__name__}: {exc}")
            return failed
        except redis.RedisError as exc:
            # The server answered but refused (OOM, WRONGTYPE, ...): it is up, so no
            # backoff, but the caller gets the failure value and the reason is kept.
            self.errors.append(f"{what}: refused: {type(exc).__name__}: {exc}")
            self._up()
            return failed
        self._up()
        return result

    def _down(self, reason: str) -> None:
        self._backoff_s = BACKOFF_START_S if self.connected else min(2 * self._backoff_s, BACKOFF_MAX_S)
        self._retry_at = time.monotonic() + self._backoff_s
        if self.connected:
            self.connected = False
            log.warning("control bus for job %s lost Redis: %s", self.job, reason)
            self._notify(False, reason)

    def _up(self) -> None:
        if not self.connected:
            self.connected = True
            self._backoff_s = 0.0
            log.info("control bus for job %s reconnected to Redis", self.job)
            self._notify(True, "reconnected")

    def _notify(self, up: bool, reason: str) -> None:
        if self.on_state is None:
            return
        try:
            self.on_state(up, reason)
        except Exception as exc:  # noqa: BLE001 - a broken callback must not break the Bus
            self.errors.append(f"on_state({up}, ...) raised {type(exc).__name__}: {exc}")

    def _check_server(self) -> bool:
        """After a (re)connect: fix the start point, and rewind positions on a new server."""
        try:
            info = self._client.info("server")
            run_id: str | None = str(info["run_id"])
            now_ms = int(info["server_time_usec"]) // 1000
        except (redis.ResponseError, KeyError, ValueError):
            # A Redis that hides INFO (or predates server_time_usec): fall back to the
            # server's TIME and give up on restart detection rather than on the Bus.
            seconds, micros = self._client.time()
            run_id, now_ms = None, int(seconds) * 1000 + int(micros) // 1000
        if self._start is None:
            # Entries from this millisecond on; one from just before may slip in, which
            # is the safe side of the race.
            self._start = (now_ms - 1, MAX_SEQ) if now_ms > 0 else (0, 0)
        elif self._run_id is not None and run_id is not None and run_id != self._run_id:
            if self._start > (now_ms, 0):
                self._start = (0, 0)
            for stream, pos in list(self._positions.items()):
                if self._last_id(self.key(stream)) < pos:
                    self._positions[stream] = (0, 0)
            log.info("control bus for job %s: Redis restarted (run_id %s), positions checked", self.job, run_id)
        self._run_id = run_id
        self._new_connection = False
        return True

    def _last_id(self, key: str) -> StreamId:
        try:
            info = self._client.xinfo_stream(key)
        except redis.ResponseError:
            return (0, 0)  # no such stream (yet)
        return _parse_id(_text(info["last-generated-id"]))

    # --- reading ------------------------------------------------------------------------

    def _xread(self, keys: dict[str, str], block_ms: int, requested_ms: int, count: int | None = None) -> Any:
        start = self._start if self._start is not None else (0, 0)
        ids = {key: _format_id(self._positions.get(name, start)) for key, name in keys.items()}
        if requested_ms <= 0:
            return self._client.xread(ids, count=count)
        return self._blocking_client(requested_ms).xread(ids, count=count, block=block_ms)

    def _blocking_client(self, block_ms: int) -> redis.Redis:
        """A client whose socket timeout covers the block: redis-py does not stretch
        the timeout for XREAD BLOCK, so a shared one would time out every long wait.
        Kept for the longest ``block_ms`` asked so far (its timeout covers any shorter
        block), so that a consumer that waits briefly while busy and longer while idle
        reuses one connection rather than rebuilding it at every change."""
        if self._blocking is None or self._blocking[0] < block_ms:
            if self._blocking is not None:
                self._blocking[1].close()
            self._blocking = (block_ms, self._make_client(self.socket_timeout_s + block_ms / 1000))
        return self._blocking[1]

    def _entries(self, reply: Any, keys: dict[str, str]) -> Iterator[tuple[str, str, Any]]:
        """``(stream, entry id, fields)`` of each entry of an XREAD ``reply``, in order,
        moving the stream's position past each."""
        if isinstance(reply, dict):  # RESP3: {key: [entries]}
            items: Iterable[Any] = ((key, value[0] if value else []) for key, value in reply.items())
        else:  # RESP2: [[key, entries], ...]
            items = reply or []
        for key, entries in items:
            stream = keys.get(_text(key))
            if stream is None:
                continue
            for entry_id, fields in entries:
                eid = _text(entry_id)
                self._positions[stream] = _parse_id(eid)
                yield stream, eid, fields

    def _deliver(self, reply: Any, keys: dict[str, str], accept: set[str] | None, out: list[tuple[str, Any]],
                 later: Callable[[Any], bool] | None = None) -> None:
        now = time.monotonic()
        for stream, eid, fields in self._entries(reply, keys):
            raw = self._raw(stream, eid, fields)
            if raw is None:
                continue
            if later is not None and later(raw):
                self._later.append((now, stream, eid, raw))
                continue
            self._decode_into(stream, eid, raw, accept, out)

    def _decode_into(self, stream: str, eid: str, raw: Any, accept: set[str] | None,
                     out: list[tuple[str, Any]]) -> None:
        try:
            out.append((stream, codec.decode(raw, accept)))
        except MessageError as exc:
            self.drop(f"dropped {stream} entry {eid}: {exc}")

    def _deliver_raw(self, reply: Any, keys: dict[str, str], out: list[tuple[str, str, bytes]]) -> None:
        for stream, eid, fields in self._entries(reply, keys):
            raw = self._raw(stream, eid, fields)
            if raw is not None:
                out.append((stream, eid, raw))

    def _raw(self, stream: str, entry_id: str, fields: Any) -> Any:
        """The message text of an entry; None (dropped, counted) without exactly the field."""
        names = {_text(k) for k in (fields or {})}
        if names == {FIELD}:
            return next(iter(fields.values()))
        self.drop(f"dropped {stream} entry {entry_id}: expected exactly field {FIELD!r}, got {sorted(names)}")
        return None

    def drop(self, why: str) -> None:
        """Count a malformed entry as dropped, and keep ``why`` (one line) among the errors."""
        self.dropped += 1
        self.errors.append(why)


def bus_text(msg: Any) -> str:
    """``msg`` encoded for the bus; MessageError when it is over the cap (every reader would
    drop it: better the sender learns here)."""
    data = codec.encode(msg)
    size = len(data.encode("utf-8"))
    if size > codec.MAX_MESSAGE_BYTES:
        raise MessageError(f"{type(msg).__name__} of {size} bytes exceeds {codec.MAX_MESSAGE_BYTES}")
    return data


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _parse_id(entry_id: str) -> StreamId:
    if entry_id == "0":
        return (0, 0)
    m = _ID.match(entry_id)
    if m is None:
        raise ValueError(f"not a stream id: {entry_id!r} (expected MS-SEQ, e.g. '0-0')")
    return int(m.group(1)), int(m.group(2))


def _format_id(entry_id: StreamId) -> str:
    return f"{entry_id[0]}-{entry_id[1]}"


__all__ = ["Bus"]
