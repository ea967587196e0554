"""A job's control plane spread over the shards of a Redis Cluster.

On one Redis server every process of a job talks through one :class:`~falconext.control.bus.Bus`.
On a cluster (``--falcon-redis-shards N`` or a URL file naming one) the streams are spread
by node: node ``n``'s streams (its ranks' ``node:n``, and its copies ``ctl@n``,
``beats@n``, ``cmd@n`` of the streams every node has) live on shard ``n mod N``, under a
hash tag whose slot that shard serves, so one node's traffic stays on one shard and one
XREAD reads all of a node agent's input. The controller reads every shard's ``ctl`` and
``beats`` and posts each command to every shard's ``cmd``; the job's keys (status,
liveness, replies, operator commands, spares) live on shard 0.

:class:`ShardedBus` is one plain Bus per shard, talking to the shard's own address (the
slot map is read once, when the launcher starts the job, and travels in the URL the
processes get: :func:`cluster_url`). A plain client per shard rather than redis-py's
``RedisCluster`` keeps the Bus's promises shard by shard: fail-open with its own backoff,
restart detection by ``run_id``, and no slot-map refresh storms while a shard is away. A
lost shard costs only its nodes' control traffic until it is back, and the processes say
so (``on_state`` names the shard).
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.crc import key_slot

from falconext.control.bus import ERRORS_KEPT, Bus, bus_text
from falconext.control.redis_client import redis_client, where
from falconext.control.redis_server import RedisUnavailable

#: what follows the URL's ``#``: the cluster's shards, in slot order
SHARDS_MARK = "shards="
#: streams every node has a copy of (``name@node``) that the controller reads: read
#: without a node, every shard's copy; posted without one (an operator, a launcher), shard 0's
TO_CONTROLLER = frozenset({"ctl", "beats"})
#: the stream every node has a copy of that the controller posts to: posted without a node,
#: to every shard's copy; read without one, shard 0's
TO_NODES = frozenset({"cmd"})

_NAMED_NODE = re.compile(r"^(?:node:(\d+)|[^@]+@(\d+))$")
_SHARD = re.compile(r"^([^:/,]+):(\d+)/([A-Za-z0-9.]+)$")


@dataclass(frozen=True)
class Shard:
    """One master of a cluster: where it listens, and a hash tag whose slot it serves."""

    host: str
    port: int
    tag: str


def tag_for(lo: int, hi: int) -> str:
    """The first of ``s0``, ``s1``, ... whose hash slot lies in ``lo..hi`` (pure)."""
    for i in range(1 << 20):
        tag = f"s{i}"
        if lo <= key_slot(tag.encode()) <= hi:
            return tag
    raise ValueError(f"no tag hashes into slots {lo}..{hi}")


def read_shards(url: str, timeout_s: float = 2.0) -> list[Shard]:
    """The masters of the cluster at ``url`` in the order of their first slot, each with
    its tag; RedisUnavailable (one line) when the cluster does not answer."""
    client = redis_client(url, timeout_s)
    try:
        rows = client.execute_command("CLUSTER", "SLOTS")
    except redis.RedisError as exc:
        raise RedisUnavailable(f"Redis Cluster at {where(url)} did not give its slot map: "
                               f"{type(exc).__name__}: {exc}") from None
    finally:
        client.close()
    first: dict[tuple[str, int], tuple[int, int]] = {}
    for row in rows if isinstance(rows, list) else []:
        lo, hi, master = int(row[0]), int(row[1]), row[2]
        host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
        addr = (host or urlsplit(url).hostname or "127.0.0.1", int(master[1]))
        if addr not in first or lo < first[addr][0]:
            first[addr] = (lo, hi)
    if not first:
        raise RedisUnavailable(f"Redis Cluster at {where(url)} serves no slots")
    return [Shard(host, port, tag_for(lo, hi)) for (host, port), (lo, hi) in sorted(first.items(), key=lambda kv: kv[1])]


def cluster_url(url: str, shards: list[Shard]) -> str:
    """``url`` (one shard's, with the password) naming the whole cluster for the job's
    processes: its shards after ``#shards=``."""
    base = url.split("#", 1)[0]
    return base + "#" + SHARDS_MARK + ",".join(f"{s.host}:{s.port}/{s.tag}" for s in shards)


def split_url(url: str) -> tuple[str, list[Shard]]:
    """(the URL without its shard list, the shards; none for a single server). ValueError
    in one line for a malformed list."""
    base, _, frag = url.partition("#")
    if not frag:
        return base, []
    if not frag.startswith(SHARDS_MARK):
        raise ValueError(f"control-plane URL: unexpected fragment {frag.split('=', 1)[0]!r} (expected {SHARDS_MARK}...)")
    shards = []
    for item in frag[len(SHARDS_MARK):].split(","):
        m = _SHARD.match(item)
        if m is None:
            raise ValueError(f"control-plane URL: shard {item!r} is not HOST:PORT/TAG")
        shards.append(Shard(m.group(1), int(m.group(2)), m.group(3)))
    return base, shards


def shard_url(base: str, shard: Shard) -> str:
    """``base`` (password and database kept) pointing at ``shard``."""
    parts = urlsplit(base)
    auth = parts.netloc.rpartition("@")[0]
    netloc = (auth + "@" if auth else "") + f"{shard.host}:{shard.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


def home(url: str, job: str) -> tuple[str, str]:
    """(URL, key prefix) of where a job's own keys live: the status, the controller's
    liveness, operator commands and replies (the server, or a cluster's shard 0)."""
    base, shards = split_url(url)
    if not shards:
        return base, f"falcon:{job}:"
    return shard_url(base, shards[0]), f"falcon:{{{shards[0].tag}}}:{job}:"


def route(name: str, shards: int, post: bool = False) -> int | None:
    """The shard of stream or key ``name`` among ``shards`` (None: every shard): a node's
    (``node:N``, ``base@N``) on shard N mod shards; one of :data:`TO_CONTROLLER` read
    without a node, or of :data:`TO_NODES` posted without one, on every shard; anything
    else on shard 0."""
    m = _NAMED_NODE.match(name)
    if m is not None:
        return int(m.group(1) or m.group(2)) % shards
    return None if name in (TO_NODES if post else TO_CONTROLLER) else 0


class ShardedBus:
    """The Bus of a job on a Redis Cluster: the same methods and promises as
    :class:`~falconext.control.bus.Bus` (fail-open, strict decoding), one Bus per shard
    underneath, each name routed by :func:`route`. Reading names on several shards
    reads each shard in turn; ``block_ms`` is shared out among them."""

    def __init__(self, url: str, job: str, *, on_state: Callable[[bool, str], None] | None = None,
                 **kwargs: Any) -> None:
        base, shards = split_url(url)
        if not shards:
            raise ValueError(f"{where(url)}: not a cluster URL (no {SHARDS_MARK} list)")
        self.url, self.job, self.shards = url, job, shards
        self.errors: deque[str] = deque(maxlen=ERRORS_KEPT)
        self._down: set[int] = set()  # the shards lost now
        self.buses = [Bus(shard_url(base, s), job, tag=s.tag, on_state=self._named(k, on_state), **kwargs)
                      for k, s in enumerate(shards)]
        for bus in self.buses:
            bus.errors = self.errors  # one list, newest last, whichever shard said it

    def _named(self, k: int, on_state: Callable[[bool, str], None] | None) -> Callable[[bool, str], None] | None:
        """Shard ``k``'s state callback: ``on_state(False, ...)`` when the first shard is
        lost, ``on_state(True, ...)`` when the last lost one is back, each naming the shard."""
        if on_state is None:
            return None
        label = f"shard {k} ({self.shards[k].host}:{self.shards[k].port})"

        def changed(ok: bool, why: str) -> None:
            was = bool(self._down)
            (self._down.discard if ok else self._down.add)(k)
            if was != bool(self._down):
                on_state(ok, f"{label}: {why}")

        return changed

    # --- state across the shards ---------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Every shard answered its last call."""
        return all(b.connected for b in self.buses)

    @property
    def dropped(self) -> int:
        """Entries dropped as malformed, on every shard."""
        return sum(b.dropped for b in self.buses)

    @property
    def deferred(self) -> int:
        """Entries put aside by reads on every shard (Bus.deferred)."""
        return sum(b.deferred for b in self.buses)

    def deferred_since(self) -> float | None:
        """When the oldest entry put aside on any shard was read; None: none is."""
        return min((t for t in (b.deferred_since() for b in self.buses) if t is not None), default=None)

    def take_later(self, most: int) -> list[tuple[str, Any]]:
        """Up to ``most`` of the entries put aside, the oldest shard's first (Bus.take_later)."""
        out: list[tuple[str, Any]] = []
        for bus in sorted(self.buses, key=lambda b: b.deferred_since() or math.inf):
            if len(out) < most:
                out += bus.take_later(most - len(out))
        return out

    @property
    def maxlen(self) -> int:
        """The length each stream is trimmed to (every shard's Bus has the same)."""
        return self.buses[0].maxlen

    def _shards(self, name: str, post: bool = False) -> list[int]:
        """The shards holding the copies of ``name`` this Bus reads (``post``: posts to)."""
        k = route(name, len(self.buses), post)
        return list(range(len(self.buses))) if k is None else [k]

    def _on(self, name: str, post: bool = False) -> list[Bus]:
        return [self.buses[k] for k in self._shards(name, post)]

    def keys(self, name: str, post: bool = False) -> list[tuple[int, str]]:
        """(shard, Redis key) of each copy of ``name`` this Bus reads (``post``: posts to)."""
        return [(k, self.buses[k].key(name)) for k in self._shards(name, post)]

    # --- the Bus's methods ----------------------------------------------------------------

    def key(self, name: str) -> str:
        """The Redis key of ``name`` (shard 0's copy for a stream on every shard)."""
        return self._on(name)[0].key(name)

    def post(self, stream: str, msg: Any) -> bool:
        """Append ``msg`` to ``stream`` (to every shard's copy of a stream to the nodes);
        False when a shard it goes to is unreachable or refuses."""
        data = bus_text(msg)  # encoded once for every copy (a 100k-rank plan's shares: 7 MB)
        return all([b.post_text(stream, data) for b in self._on(stream, post=True)])

    def post_many(self, stream: str, msgs: list[Any]) -> bool:
        """Append ``msgs`` to ``stream`` as Bus.post_many does, on every shard's copy of a
        stream to the nodes, each encoded once."""
        datas = [bus_text(m) for m in msgs]
        return all([b.post_texts(stream, datas) for b in self._on(stream, post=True)])

    def post_raw(self, stream: str, fields: dict[str, str | bytes]) -> str | None:
        """As Bus.post_raw; on every shard's copy, the first shard's id."""
        ids = [b.post_raw(stream, fields) for b in self._on(stream, post=True)]
        return ids[0]

    def read(self, streams: list[str], block_ms: int = 0, accept: set[str] | None = None,
             count: int | None = None, later: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
        """New messages on ``streams`` as Bus.read gives them (``later``: put aside
        there), shard by shard. Waiting (``block_ms``) is shared among the shards read,
        so a message on any of them is seen within about ``block_ms``."""
        if block_ms < 0:
            raise ValueError(f"block_ms must be >= 0, got {block_ms}")
        by_shard: dict[int, list[str]] = {}
        for name in streams:
            for k in self._shards(name):
                by_shard.setdefault(k, []).append(name)
        if not by_shard:
            return []
        if len(by_shard) == 1:
            (k, names), = by_shard.items()
            return self.buses[k].read(names, block_ms=block_ms, accept=accept, count=count, later=later)
        out: list[tuple[str, Any]] = []
        for k, names in by_shard.items():
            out += self.buses[k].read(names, accept=accept, count=count, later=later)
        if out or block_ms == 0:
            return out
        deadline = time.monotonic() + block_ms / 1000
        slice_ms = max(1, block_ms // len(by_shard))
        while not out and time.monotonic() < deadline:
            for k, names in by_shard.items():
                left = int((deadline - time.monotonic()) * 1000)
                if left <= 0:
                    break
                out += self.buses[k].read(names, block_ms=min(slice_ms, left), accept=accept, count=count,
                                          later=later)
                if out:
                    break
        return out

    def trim_read(self, stream: str) -> bool:
        """As Bus.trim_read, on each shard's copy up to what this Bus read there."""
        return any([b.trim_read(stream) for b in self._on(stream)])

    def seek(self, stream: str, last_id: str) -> None:
        """As Bus.seek, on each shard's copy."""
        for b in self._on(stream):
            b.seek(stream, last_id)

    def position(self, stream: str) -> str | None:
        """As Bus.position (shard 0's copy for a stream on every shard)."""
        return self._on(stream)[0].position(stream)

    def ping(self) -> bool:
        """True when every shard answered PING now."""
        return all([b.ping() for b in self.buses])

    def beat(self, name: str, ttl_s: float) -> bool:
        """As Bus.beat, on the shard that holds ``name``."""
        return self._on(name)[0].beat(name, ttl_s)

    def put(self, name: str, value: str, ttl_s: float) -> bool:
        """As Bus.put, on the shard that holds ``name``."""
        return self._on(name)[0].put(name, value, ttl_s)

    def get(self, name: str) -> str | None:
        """As Bus.get, on the shard that holds ``name``."""
        return self._on(name)[0].get(name)

    def alive(self, name: str) -> bool | None:
        """As Bus.alive, on the shard that holds ``name``."""
        return self._on(name)[0].alive(name)

    def names(self, prefix: str, most: int = 1000) -> list[str] | None:
        """As Bus.names, on the shard that holds names with ``prefix`` (shard 0)."""
        return self._on(prefix)[0].names(prefix, most)

    def close(self) -> None:
        """Close every shard's connections; never raises, safe to call twice."""
        for b in self.buses:
            b.close()

    def __enter__(self) -> ShardedBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: a job's bus, on one server or a cluster
AnyBus = Bus | ShardedBus


def open_bus(url: str, job: str, **kwargs: Any) -> AnyBus:
    """The bus of a job: a :class:`ShardedBus` for a cluster URL (:func:`cluster_url`), a
    :class:`~falconext.control.bus.Bus` otherwise; keyword arguments as Bus takes them."""
    return ShardedBus(url, job, **kwargs) if "#" in url else Bus(url, job, **kwargs)


__all__ = ["AnyBus", "TO_CONTROLLER", "TO_NODES", "Shard", "ShardedBus", "cluster_url", "home", "open_bus", "read_shards", "route",
           "shard_url", "split_url", "tag_for"]
