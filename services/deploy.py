"""`mariana deploy install`: put the systemd units and the configs of a systemd
host in place, and say what to run next.

    PREFIX/etc/systemd/system/   every unit of deploy/systemd/, its ExecStart= pointed at
                                 this install's `mariana` (and redis-server found like
                                 `mariana up` finds it); rewritten on every install
    PREFIX/etc/mariana/          cluster.toml, serve.toml, redis.conf, prometheus.yml from
                                 deploy/; never overwritten (an edited config is kept)

The deploy files come from the checkout (deploy/ beside services/) or, for an
installed wheel, from <prefix>/share/mariana/deploy (pyproject's data-files).
Nothing is started: the commands printed at the end create the user and
enable the units, one instance per index the cluster config counts.
"""
from __future__ import annotations

import os
import site
import sys
from dataclasses import dataclass, field
from pathlib import Path

from sparse.errors import MarianaError

# What the shipped units run; replaced by the paths of this install.
UNIT_MARIANA = "/opt/mariana/.venv/bin/mariana"
UNIT_REDIS = "/usr/bin/redis-server"
# deploy/ file -> its name in /etc/mariana
CONFIGS = {"config/cluster.systemd.toml": "cluster.toml", "config/serve.systemd.toml": "serve.toml",
           "config/redis.conf": "redis.conf", "prometheus/prometheus.yml": "prometheus.yml"}
SECRET = ("cluster.toml", "serve.toml", "redis.conf")  # may hold tokens: written 0640, for group mariana
# One instance per index: the templates, in start order, and the cluster config count they follow.
TEMPLATES = (("mariana-ps@", "ps"), ("mariana-preprocess@", "preprocess"), ("mariana-worker@", "worker"))
SINGLE = ("mariana-redis", "mariana-coordinator", "mariana-loader")


@dataclass
class Plan:
    """What an install writes (path -> text), keeps, and the commands to run after it."""
    prefix: Path
    source: Path
    write: dict[Path, str] = field(default_factory=dict)
    unchanged: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)


def deploy_dir() -> Path:
    """deploy/ of the checkout this module runs from, else the one installed with the wheel."""
    candidates = [Path(__file__).resolve().parents[1] / "deploy",
                  Path(sys.prefix) / "share" / "mariana" / "deploy",
                  Path(site.getuserbase()) / "share" / "mariana" / "deploy"]
    for d in candidates:
        if (d / "systemd" / "mariana.target").is_file():
            return d
    raise MarianaError(f"the deploy files are not installed: none of {', '.join(map(str, candidates))} "
                       "holds systemd/mariana.target")


def default_mariana() -> str:
    """The `mariana` script beside the interpreter running now (this install's)."""
    return str(Path(sys.executable).parent / "mariana")


def default_redis_server() -> str:
    from services.launcher import find_redis_server

    try:
        return find_redis_server()
    except MarianaError:
        return UNIT_REDIS  # what `apt-get install redis-server` provides


def plan_install(prefix: str, mariana: str | None = None, redis_server: str | None = None) -> Plan:
    root = Path(prefix).expanduser().absolute()
    plan = Plan(root, deploy_dir())
    mariana, redis_server = mariana or default_mariana(), redis_server or default_redis_server()
    units = root / "etc" / "systemd" / "system"
    for unit in sorted((plan.source / "systemd").iterdir()):
        if unit.suffix in (".service", ".timer", ".target"):
            text = unit.read_text().replace(UNIT_MARIANA, mariana).replace(UNIT_REDIS, redis_server)
            _add(plan, units / unit.name, text, replace=True)
    etc = root / "etc" / "mariana"
    for src, name in CONFIGS.items():
        _add(plan, etc / name, (plan.source / src).read_text(), replace=False)
    plan.commands = _commands(plan, etc / "cluster.toml")
    _check_writable(plan)
    return plan


def _add(plan: Plan, dest: Path, text: str, replace: bool) -> None:
    try:
        old = dest.read_text() if dest.is_file() else None
    except OSError as e:
        raise MarianaError(f"{dest}: cannot read it: {e.strerror}") from None
    if old is None:
        plan.write[dest] = text
    elif old == text:
        plan.unchanged.append(dest)
    elif replace:
        plan.write[dest] = text
    else:
        plan.kept.append(dest)


def _commands(plan: Plan, cluster_toml: Path) -> list[str]:
    """useradd, daemon-reload, enable: the unit instances follow the counts of the cluster
    config that will be in place (the kept one when there is one)."""
    from services.runtime.config import load_cluster_config

    config = cluster_toml if cluster_toml in plan.kept + plan.unchanged else plan.source / "config/cluster.systemd.toml"
    try:
        cfg = load_cluster_config(config, env={})
    except MarianaError as e:
        raise MarianaError(f"{config}: {e}") from None
    units = [f"{name}.service" for name in SINGLE]
    for template, role in TEMPLATES:
        units += [f"{template}{i}.service" for i in range(cfg.count(role))]
    etc = "/etc/mariana"
    return ["id -u mariana >/dev/null 2>&1 || useradd --system --home-dir /var/lib/mariana "
            "--shell /usr/sbin/nologin mariana",
            "install -d -o mariana -g mariana -m 0750 /var/lib/mariana /var/lib/mariana/models /var/lib/mariana/logs",
            "chgrp mariana " + " ".join(f"{etc}/{name}" for name in SECRET),
            "systemctl daemon-reload",
            "systemctl enable --now mariana.target " + " ".join(units) + " mariana-serve.service",
            "systemctl enable --now mariana-retrain.timer"]


def _check_writable(plan: Plan) -> None:
    """Fail before writing anything when a directory to write in cannot be made or written."""
    for d in sorted({p.parent for p in plan.write}):
        existing = d
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise MarianaError(f"{d}: cannot write there: {existing} is not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise MarianaError(f"{d}: cannot write there: {existing} is not writable")


def apply(plan: Plan) -> None:
    for dest, text in plan.write.items():
        secret = dest.parent.name == "mariana" and dest.name in SECRET  # tokens, passwords
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640 if secret else 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, dest)
        except OSError as e:
            raise MarianaError(f"{dest}: cannot write it: {e.strerror}") from None


def report(plan: Plan, dry_run: bool) -> str:
    """What was (or would be) written and kept, then the commands to run."""
    verb = "would write" if dry_run else "wrote"
    lines = [f"deploy files from {plan.source}"]
    lines += [f"{verb:>12}  {p}" for p in plan.write]
    lines += [f"{'unchanged':>12}  {p}" for p in plan.unchanged]
    for p in plan.kept:
        src = next(plan.source / s for s, name in CONFIGS.items() if name == p.name)
        lines.append(f"{'kept':>12}  {p} (it exists and may be edited: not overwritten; the shipped one is {src})")
    lines.append("")
    if plan.prefix != Path("/"):
        lines.append(f"The files are under {plan.prefix}; on the host they go to the same paths under /.")
    lines.append("Then, as root:" if not dry_run else "After installing, as root:")
    lines += [f"  {c}" for c in plan.commands]
    return "\n".join(lines)


def install(prefix: str = "/", dry_run: bool = False, mariana: str | None = None,
            redis_server: str | None = None) -> str:
    plan = plan_install(prefix, mariana, redis_server)
    if not dry_run:
        apply(plan)
    return report(plan, dry_run)
