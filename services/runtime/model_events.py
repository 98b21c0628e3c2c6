"""Announcements of model versions on Redis pub/sub: the one place that says
what the channel is and what a message holds. Trainers (the coordinator, a
local `mariana train --notify`, retrain, `mariana model promote|rollback`)
publish; servers subscribe and, on any message naming their model
directory, look at its CURRENT again. The directory stays the truth: a lost
message costs a server one poll interval, never a wrong model.

    {"event": "trained" | "promoted" | "rollback" | "candidate",
     "model_dir": "/abs/path", "version": "v000007", "current": "v000007", "time": 1795390000.0}

`candidate` is a version written without becoming CURRENT (a retrain's new
model before the gate decides).
"""
from __future__ import annotations

import json
import logging
import os
import time

from mariana.services.runtime.redis_url import redact
from mariana.sparse.files import loads_json

log = logging.getLogger(__name__)
CHANNEL = "mariana:models"
EVENTS = ("trained", "promoted", "rollback", "candidate")


def message(event: str, model_dir: str, version: str, current: str | None) -> str:
    if event not in EVENTS:
        raise ValueError(f"unknown model event {event!r}")
    return json.dumps({"event": event, "model_dir": os.path.realpath(model_dir), "version": version,
                       "current": current, "time": time.time()})


def parse(data: bytes | str) -> dict | None:
    """A received message as a dict, or None when it is not one of ours."""
    try:
        msg = loads_json(data)
    except (ValueError, TypeError):
        return None
    if not isinstance(msg, dict) or msg.get("event") not in EVENTS or not isinstance(msg.get("model_dir"), str):
        return None
    return msg


def concerns(msg: dict, model_dir: str) -> bool:
    return msg["model_dir"] == os.path.realpath(model_dir)


def publish(url: str, event: str, model_dir: str, version: str, current: str | None,
            channel: str = CHANNEL) -> int:
    """Publish from a synchronous caller (the CLI, retrain); returns the number of
    subscribers reached. Redis being down is logged, not raised: servers poll too."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        try:
            n = int(client.publish(channel, message(event, model_dir, version, current)))
        finally:
            client.close()
    except redis.RedisError as e:
        log.warning("could not announce %s %s on %s: %s (servers will see it at their next poll)",
                    event, version, redact(url), e)
        return 0
    log.info("announced %s %s of %s to %d subscriber(s)", event, version, model_dir, n)
    return n


async def publish_async(client, event: str, model_dir: str, version: str, current: str | None,
                        channel: str = CHANNEL) -> int:
    """The same from an asyncio service holding a `redis.asyncio` client."""
    import redis

    try:
        return int(await client.publish(channel, message(event, model_dir, version, current)))
    except (redis.RedisError, OSError) as e:
        log.warning("could not announce %s %s: %s (servers will see it at their next poll)", event, version, e)
        return 0
