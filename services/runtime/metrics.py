"""Prometheus metrics as mergeable state: counters, gauges and histograms with
labels, kept as a plain dict that is JSON as it stands, so processes serving
one endpoint can write theirs to a file and any of them can answer a scrape
with the sum (`merge`), rendered in the text exposition format.

A counter is 0 from its definition (an unlabelled one, or each label set given as
`start`), not absent until its first event: `increase(x[10m]) > 0` sees the first one.

>>> m = Metrics()
>>> m.counter("requests_total", "Requests answered.", start=())  # labels not known beforehand
>>> m.histogram("latency_seconds", "Request latency.", buckets=(0.01, 0.1))
>>> m.inc("requests_total", code="200"); m.observe("latency_seconds", 0.05)
>>> print(render(m.definitions, merge([m.state(), m.state()])), end="")
# HELP requests_total Requests answered.
# TYPE requests_total counter
requests_total{code="200"} 2
# HELP latency_seconds Request latency.
# TYPE latency_seconds histogram
latency_seconds_bucket{le="0.01"} 0
latency_seconds_bucket{le="0.1"} 2
latency_seconds_bucket{le="+Inf"} 2
latency_seconds_sum 0.1
latency_seconds_count 2
"""
from __future__ import annotations

import bisect
import functools
import math

# state: {metric: {label text: value}}; a histogram's value is [bucket counts..., +Inf count, sum]
State = dict[str, dict[str, object]]
DEFAULT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self) -> None:
        self.definitions: dict[str, dict] = {}
        self._values: State = {}

    def counter(self, name: str, help: str, start: tuple[dict[str, str], ...] = ({},)) -> None:
        """`start`: the label sets that are 0 from now on (default: the unlabelled series;
        `()`: none, for a counter whose label values come with its events).

        >>> m = Metrics(); m.counter("a", "."); m.counter("b", ".", start=({"x": "1"}, {"x": "2"}))
        >>> m.state()
        {'a': {'': 0}, 'b': {'x="1"': 0, 'x="2"': 0}}
        """
        self._define(name, "counter", help)
        for labels in start:
            self._values[name][_labels(labels)] = 0

    def gauge(self, name: str, help: str) -> None:
        self._define(name, "gauge", help)

    def histogram(self, name: str, help: str, buckets: tuple[float, ...] = DEFAULT_BUCKETS) -> None:
        self._define(name, "histogram", help, buckets=tuple(sorted(buckets)))

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        series = self._values[name]
        key = _labels(labels)
        series[key] = series.get(key, 0) + amount

    @staticmethod
    def key(**labels: str) -> str:
        """A series' label text, for `add` and `observe_at`: a request's path keeps the keys of
        its few label sets instead of making them from keyword arguments each time.

        >>> m = Metrics(); m.counter("c", ".", start=()); k = m.key(code="200")
        >>> m.add("c", k); m.add("c", k, 2); m.value("c", code="200")
        3
        """
        return _labels(labels)

    def add(self, name: str, key: str, amount: float = 1) -> None:
        """`inc` of the series whose label text is `key` (`Metrics.key`)."""
        series = self._values[name]
        series[key] = series.get(key, 0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        self._values[name][_labels(labels)] = value

    def remove(self, name: str, **labels: str) -> None:
        self._values[name].pop(_labels(labels), None)

    def observe(self, name: str, value: float, **labels: str) -> None:
        self.observe_at(name, _labels(labels), value)

    def observe_at(self, name: str, key: str, value: float) -> None:
        """`observe` in the series whose label text is `key` (`Metrics.key`)."""
        buckets = self.definitions[name]["buckets"]
        series = self._values[name]
        h = series.get(key)
        if h is None:
            h = series[key] = [0] * (len(buckets) + 1) + [0.0]
        h[bisect.bisect_left(buckets, value)] += 1  # per bucket (le: value <= bound); cumulative when rendered
        h[-1] += value

    def value(self, name: str, **labels: str) -> float:
        """One series (a histogram's count); with no labels, the sum of all of them.

        >>> m = Metrics(); m.counter("c", ".", start=()); m.inc("c", code="200"); m.inc("c", 2, code="400")
        >>> m.value("c"), m.value("c", code="400")
        (3, 2)
        """
        count = lambda v: v if not isinstance(v, list) else sum(v[:-1])  # noqa: E731
        series = self._values[name]
        if labels:
            return count(series.get(_labels(labels), 0))
        return sum(count(v) for v in series.values())

    def carry_over(self, state: State) -> None:
        """Start the counters and histograms from `state`, what this process's predecessor
        reported (a restarted worker of a server): its sums go on, and a scrape of the
        server's total never goes down. Gauges start afresh; a series of another shape is
        left out.

        >>> m = Metrics(); m.counter("c", "."); m.gauge("g", "."); m.inc("c", 2)
        >>> m.set("g", 5); after = Metrics(); after.counter("c", "."); after.gauge("g", ".")
        >>> after.carry_over(m.state()); after.inc("c"); after.state()
        {'c': {'': 3}, 'g': {}}
        """
        for name, series in state.items():
            d = self.definitions.get(name)
            if d is None or d["type"] == "gauge" or not isinstance(series, dict):
                continue
            width = len(d["buckets"]) + 2 if d["type"] == "histogram" else None
            for key, v in series.items():
                if width is not None and isinstance(v, list) and len(v) == width:
                    self._values[name][key] = list(v)
                elif width is None and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._values[name][key] = v

    def state(self) -> State:
        """A copy of every series, JSON as it stands."""
        return {name: {k: (list(v) if isinstance(v, list) else v) for k, v in series.items()}
                for name, series in self._values.items()}

    def _define(self, name: str, kind: str, help: str, **extra) -> None:
        if name in self.definitions:
            raise ValueError(f"metric {name!r} defined twice")
        self.definitions[name] = {"type": kind, "help": help, **extra}
        self._values[name] = {}


def merge(states: list[State]) -> State:
    """The sum of several processes' states, series by series."""
    out: State = {}
    for state in states:
        for name, series in state.items():
            into = out.setdefault(name, {})
            for key, v in series.items():
                have = into.get(key)
                if have is None:
                    into[key] = list(v) if isinstance(v, list) else v
                elif isinstance(v, list) and isinstance(have, list) and len(v) == len(have):
                    into[key] = [a + b for a, b in zip(have, v)]
                elif not isinstance(v, list) and not isinstance(have, list):
                    into[key] = have + v
    return out


def render(definitions: dict[str, dict], state: State) -> str:
    lines = []
    for name, d in definitions.items():
        lines += [f"# HELP {name} {d['help']}", f"# TYPE {name} {d['type']}"]
        for key, v in sorted(state.get(name, {}).items()):
            if d["type"] != "histogram":
                lines.append(f"{name}{_braces(key)} {_num(v)}")
                continue
            total = 0
            for le, count in zip([*map(_num, d["buckets"]), "+Inf"], v[:-1]):
                total += count
                bucket = _join(key, 'le="' + le + '"')
                lines.append(f"{name}_bucket{_braces(bucket)} {total}")
            lines += [f"{name}_sum{_braces(key)} {_num(v[-1])}", f"{name}_count{_braces(key)} {total}"]
    return "\n".join(lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    """The label text of a series, made once per distinct label set (metrics are
    updated on every request; their label sets are few)."""
    return _label_text(tuple(labels.items())) if labels else ""


@functools.lru_cache(maxsize=4096)
def _label_text(items: tuple) -> str:
    return ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(items))


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _join(a: str, b: str) -> str:
    return f"{a},{b}" if a else b


def _braces(key: str) -> str:
    return f"{{{key}}}" if key else ""


def _num(v: float) -> str:
    if isinstance(v, float):
        if math.isinf(v):
            return "+Inf" if v > 0 else "-Inf"
        return repr(round(v, 9)) if v != int(v) else str(int(v))
    return str(v)
