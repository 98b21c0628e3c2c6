"""Whom the coordinator takes at `Hello`, the first message of every service.

A cluster deployed host by host runs one config on every host; what goes wrong is a host
whose copy differs, or a service started twice. Each shows here, at registration, as an
`Error` the service exits on with the reason, instead of a job that hangs at 0 rows:

    Refused    (not retried: the service exits at once, naming what differs)
               - a role, or an index past its count, that the coordinator's config has not;
               - settings every host must share (`cluster_shape`: shard and preprocess counts
                 and endpoints, the worker count) that differ from the coordinator's;
               - a sample cache that is another Redis, or another database of it, than the
                 coordinator's (a host whose redis.url says 127.0.0.1 reaches its own Redis).
    NameTaken  (retried until the service's start time is over)
               - another process that said Hello under this name, and that the coordinator
                 heard from within `coordinator.heartbeat_seconds`. A restart where the old pid
                 is its own (one kernel boot, one pid namespace) names the pid it replaces once
                 it sees it gone, and is taken at once; a second live process keeps being
                 refused. A process that lost its name while silent is refused its heartbeats
                 and leases, and stops (`touch`; the service exits 78).
"""
from __future__ import annotations

import logging
import time

from mariana.services.protocol import Message, NameTaken, NotYet, Refused, encode
from mariana.services.runtime.config import ROLES, cluster_shape

SAY_AGAIN_SECONDS = 60.0  # a refusal that goes on is said again this often
MAX_REFUSED = 64  # refused names the coordinator remembers (status, a waiting job's failure)
REDIS_ID_SECONDS = 10.0  # how long the coordinator trusts its own Redis identity before asking again

log = logging.getLogger(__name__)


def shape_differences(mine: dict, theirs: dict) -> list[str]:
    """The shared settings where a service's config differs from the coordinator's.

    >>> shape_differences({"ps.count": 2, "worker.count": 1}, {"ps.count": 3, "worker.count": 1})
    ["ps.count = 3 there, 2 in the coordinator's"]
    """
    return [f"{key} = {theirs[key]!r} there, {value!r} in the coordinator's"
            for key, value in mine.items() if key in theirs and theirs[key] != value]


def redis_difference(mine: dict | None, theirs: dict | None) -> str | None:
    """Why a service's sample cache is not the coordinator's; None when it is, or when either
    side could not tell (its Redis did not answer: the job finds out, and says so).

    >>> why = redis_difference({"server": "a1", "db": 0, "url": "redis://h:1/0"},
    ...                        {"server": "a1", "db": 1, "url": "redis://h:1/1"})
    >>> for part in why.split("; "):
    ...     print(part)
    its redis.url redis://h:1/1 reaches database 1 of Redis server a1
    the coordinator's redis://h:1/0 database 0 of a1
    >>> redis_difference({"server": "a1", "db": 0, "url": "u"}, None) is None
    True
    """
    if not mine or not isinstance(theirs, dict) or not mine.get("server") or not theirs.get("server"):
        return None
    if (theirs["server"], theirs.get("db")) == (mine["server"], mine["db"]):
        return None
    return (f"its redis.url {theirs.get('url')} reaches database {theirs.get('db')} of Redis server "
            f"{str(theirs['server'])[:12]}; the coordinator's {mine['url']} database {mine['db']} of "
            f"{mine['server'][:12]}")


async def admit(coord, msg: Message, name: str) -> None:
    """Refused or NameTaken for a Hello the coordinator does not take (see the module's doc).
    A refusal stays in `coord.refused` (status, and a job that waits for that service) until
    a Hello under that name is taken."""
    try:
        await _admit(coord, msg, name)
    except (Refused, NameTaken, NotYet) as e:
        # said once per service and cause (every second or heartbeat it asks again), then each minute
        key, now = (name, type(e).__name__, str(e) if isinstance(e, Refused) else ""), time.monotonic()
        if now - coord.hello_said.get(key, float("-inf")) > SAY_AGAIN_SECONDS:
            log.warning("%s: %s %s: %s", coord.name, "refused" if isinstance(e, Refused) else "not yet",
                        name, e)
            coord.hello_said[key] = now
            if len(coord.hello_said) > 4 * MAX_REFUSED:
                coord.hello_said.clear()
        e.said = True
        if isinstance(e, Refused) and name[:name.rfind("-")] in ROLES:
            coord.refused[name] = (time.time(), str(e))
            while len(coord.refused) > MAX_REFUSED:  # names come from peers: bounded
                del coord.refused[min(coord.refused, key=lambda n: coord.refused[n][0])]
        raise
    coord.refused.pop(name, None)


async def _admit(coord, msg: Message, name: str) -> None:
    role, index, cfg = msg["role"], msg["index"], coord.cfg
    if role not in ROLES or role == "coordinator":
        raise Refused(f"no role {role!r} registers with a coordinator (roles: "
                      f"{', '.join(r for r in ROLES if r != 'coordinator')})")
    count = cfg.count(role)
    if not 0 <= index < count:
        raise Refused(f"no {role} #{index} in the coordinator's config: it has {role}.count = {count} "
                      f"(indexes 0-{count - 1}); every host must run the cluster's one config")
    why = []
    if isinstance(msg.get("shape"), dict):
        why += shape_differences(cluster_shape(cfg), msg["shape"])
    if isinstance(msg.get("redis"), dict):
        mine = await redis_identity(coord)
        if mine and mine.get("server") and not msg["redis"].get("server"):  # asked again each second
            raise NotYet(f"{name}'s redis.url {msg['redis'].get('url')} does not answer, while the coordinator's "
                         f"{mine['url']} does (every host's redis.url must name the cluster's Redis, by an address "
                         "that host reaches)")
        if (differs := redis_difference(mine, msg["redis"])) is not None:
            # once more with a fresh look: a Redis restarted since the coordinator's last has a new run_id
            differs = redis_difference(await redis_identity(coord, fresh=True), msg["redis"])
        if differs:
            why.append(differs + " (the sample cache must be one Redis: give every host a redis.url naming "
                       "the same server and database, by an address each host reaches)")
    if why:
        raise Refused(f"{name}'s config differs from the coordinator's (every host must run the cluster's "
                      f"one config): " + "; ".join(why))
    info = coord.services.get(name)
    if info is None or info.boot == msg.get("boot"):
        return
    within = cfg.coordinator.heartbeat_seconds
    if not info.alive(within) or (msg.get("replaces") == info.pid and msg.get("place") == info.place):
        return  # its predecessor is gone (silent too long, or seen gone where its pid is its own)
    age = time.time() - info.last_seen
    raise NameTaken(f"{name} is already running: pid {info.pid} on {info.host or 'an unnamed host'}, heard from "
                    f"{age:.1f}s ago; a second {name} is refused (if that one has stopped, this one is taken "
                    f"once it has been silent {within:g}s)", holder=holder(info))


def bye(coord, msg: Message) -> list:
    """A service stopping cleanly (`Bye`, its last message): down at once in the status, the web
    UI and `mariana_service_up`, instead of alive until heartbeat_seconds after its last beat; a
    restart is taken at once. A Bye from a process that is not the registered one changes nothing."""
    name = f"{msg['role']}-{msg['index']}"
    info = coord.services.get(name)
    if info is not None and info.pid == msg.get("pid") and info.boot == msg.get("boot") and not info.stopped:
        info.stopped = True
        log.info("%s: %s stopped (pid %s)", coord.name, name, info.pid)
    return encode("Ok", msg.msg_id)


def holder(info) -> dict:
    return {"pid": info.pid, "host": info.host, "place": info.place}


def touch(coord, name: str, peer: bytes, lease: bool = False) -> None:
    """A request of service `name`: it counts as heard from when it comes from the process
    registered under that name. A Lease from another process is NameTaken: one that lost its
    name while silent (stopped, cut off) and took over by a restart must not take work, nor
    keep the name's last heartbeat fresh (it kept a dead successor "alive")."""
    info = coord.services.get(name)
    if info is None:
        return
    if info.peer and peer != info.peer:
        if lease:
            raise NameTaken(f"{name} is registered as pid {info.pid} on {info.host or 'an unnamed host'}, not as "
                            "the process that sent this Lease: it takes no work", holder=holder(info))
        return
    info.last_seen = time.time()


async def redis_identity(coord, fresh: bool = False) -> dict | None:
    """The coordinator's own sample cache identity (`SampleCache.identity`), asked again after
    REDIS_ID_SECONDS, or at once when `fresh`."""
    at, ident = coord._redis_id
    if fresh or ident is None or time.monotonic() - at > REDIS_ID_SECONDS:
        ident = await coord.cache.identity()
        coord._redis_id = (time.monotonic(), ident)
    return ident
