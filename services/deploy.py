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

The units are sandboxed, and PrivateTmp= and ProtectHome= hide /tmp, /var/tmp, /home,
/root and /run/user from them. Before writing anything the install checks that what
each unit's ExecStart= needs in order to start (the program, the file it links to, a
script's #! interpreter and the file that links to, a venv's base Python, an editable
install's checkout) lies outside what that unit hides, reading the settings from the
units and their drop-ins in PREFIX/etc/systemd/system/UNIT.d/*.conf. At / a hidden
path is an error; under a staging prefix the report ends with a warning.
"""
from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import site
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mariana.sparse.errors import MarianaError

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

# What the sandbox settings hide from a unit's processes (systemd.exec(5)).
TRUE = ("1", "yes", "y", "true", "t", "on")
HOME_DIRS = ("/home", "/root", "/run/user")  # ProtectHome=yes|tmpfs empties them; read-only does not
TMP_DIRS = ("/tmp", "/var/tmp")  # PrivateTmp=yes|disconnected: the unit's own, empty
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # a unit's PATH (for #!/usr/bin/env)


@dataclass
class Plan:
    """What an install writes (path -> text), keeps, and the commands to run after it."""
    prefix: Path
    source: Path
    write: dict[Path, str] = field(default_factory=dict)
    unchanged: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)
    masked: list[Path] = field(default_factory=list)  # units linked to /dev/null (`systemctl mask`): left so
    commands: list[str] = field(default_factory=list)
    hidden: list[str] = field(default_factory=list)  # under a staging prefix: what the sandbox hides...
    fixes: list[str] = field(default_factory=list)  # ...and what to do about it (at / the install refuses)


@dataclass(frozen=True)
class Hidden:
    """A file that `program` needs in order to start, hidden from `units` by their `option`."""
    program: str
    path: str
    role: str  # how the program needs it ("its #! interpreter"); "" for the program itself
    under: str  # the hidden directory: /root
    option: str  # the setting that hides it: ProtectHome=yes
    units: tuple[str, ...]


UNIT_DOCS = "file:///opt/mariana/deploy/README.md"  # the units' Documentation= as shipped
UNIT_SPECIAL = "%\\'\";$`"  # characters of a program path that ExecStart= reads as more than a path


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
    from mariana.services.launcher import find_redis_server

    try:
        return find_redis_server()
    except MarianaError:
        return UNIT_REDIS  # what `apt-get install redis-server` provides


def plan_install(prefix: str, mariana: str | None = None, redis_server: str | None = None) -> Plan:
    if not prefix:
        raise MarianaError("--prefix is empty: name the root to install under ('/' for this host)")
    root = Path(prefix).expanduser().absolute()
    plan = Plan(root, deploy_dir())
    mariana = _program("--mariana", mariana) if mariana is not None else default_mariana()
    redis_server = _program("--redis-server", redis_server) if redis_server is not None else default_redis_server()
    units = root / "etc" / "systemd" / "system"
    docs = (plan.source / "README.md").as_uri()  # the units' Documentation=: this install's copy
    texts = {unit.name: unit.read_text().replace(UNIT_MARIANA, mariana).replace(UNIT_REDIS, redis_server)
             .replace(UNIT_DOCS, docs)
             for unit in sorted((plan.source / "systemd").iterdir())
             if unit.suffix in (".service", ".timer", ".target")}
    _check_sandbox(plan, texts, units, mariana, redis_server)
    if root == Path("/"):  # this host's layout: units whose program is not there would fail to start
        for option, program in (("--mariana", mariana), ("--redis-server", redis_server)):
            if not (os.path.isfile(program) and os.access(program, os.X_OK)):
                what = "is not a file" if os.path.exists(program) else "does not exist"
                raise MarianaError(f"{option} {program}: {what} (an executable file) on this host: every unit that "
                                   "runs it would fail to start; name the installed program")
    for name, text in texts.items():
        _add(plan, units / name, text, replace=True)
    etc = root / "etc" / "mariana"
    for src, name in CONFIGS.items():
        text = (plan.source / src).read_text()
        if name == "cluster.toml":  # a new cluster config gets its own admin token (any local user could submit)
            text, n = re.subn(r'^token = ""', f'token = "{secrets.token_urlsafe(24)}"', text, count=1, flags=re.M)
            if n != 1:  # the template changed: no config goes out without its token
                raise MarianaError(f"{plan.source / src}: no 'token = \"\"' line to put the admin token in")
        _add(plan, etc / name, text, replace=False)
    plan.commands = _commands(plan, etc / "cluster.toml")
    _check_writable(plan)
    return plan


def _program(option: str, path: str) -> str:
    """A program the units run: ExecStart= takes an absolute path with no whitespace (it
    would split there). Whether it exists is checked for an install at / only (`plan_install`):
    with --prefix the units may be for another host's layout."""
    if not os.path.isabs(path):
        raise MarianaError(f"{option} {path!r}: give an absolute path (systemd's ExecStart= takes no relative one)")
    if any(c.isspace() for c in path):
        raise MarianaError(f"{option} {path!r}: a path with whitespace splits ExecStart=; install it under a path "
                           "without any (e.g. /opt/mariana)")
    odd = sorted({c for c in path if c in UNIT_SPECIAL})
    if odd:  # %n became the unit's name, a quote unbalanced the line, a backslash was fatal
        raise MarianaError(f"{option} {path!r}: {' '.join(odd)} in a path means something else in ExecStart= "
                           "(systemd's specifiers, quoting, escapes); install it under a plain path "
                           "(e.g. /opt/mariana)")
    return path


# ---- what the sandbox hides from a unit ------------------------------------------------------

def unit_settings(text: str) -> dict[str, list[str]]:
    """Key -> its values in order, of a unit's text (with its drop-ins appended)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def _in_force(values: list[str], words: bool) -> list[str]:
    """The items of a list setting: each assignment adds (its words, or itself as one item),
    an empty one clears those before it (how a drop-in resets ExecStart=)."""
    items: list[str] = []
    for value in values:
        items = items + (value.split() if words else [value]) if value else []
    return items


def hidden_dirs(text: str) -> dict[str, str]:
    """Directory -> the setting of the unit `text` that hides it from the unit's processes."""
    s = unit_settings(text)
    hidden: dict[str, str] = {}
    home, tmp = s.get("ProtectHome", [""])[-1], s.get("PrivateTmp", [""])[-1]
    if home.lower() in TRUE + ("tmpfs",):
        hidden.update(dict.fromkeys(HOME_DIRS, f"ProtectHome={home}"))
    if tmp.lower() in TRUE + ("disconnected",):
        hidden.update(dict.fromkeys(TMP_DIRS, f"PrivateTmp={tmp}"))
    for key in ("InaccessiblePaths", "TemporaryFileSystem"):
        for item in _in_force(s.get(key, []), words=True):
            hidden[item.lstrip("-+").split(":")[0].rstrip("/") or "/"] = f"{key}={item}"
    return hidden


def exec_programs(text: str) -> list[str]:
    """The programs a unit's ExecStart= lines run: their first words, without the -@:+! flags."""
    return [line.split()[0].lstrip("-@:+!") for line in _in_force(unit_settings(text).get("ExecStart", []), False)]


def find_hidden(units: dict[str, str], needs: dict[str, list[tuple[str, str]]]) -> list[Hidden]:
    """What the units hide of the files their programs need.

    `units`: unit name -> its text (drop-ins appended); `needs`: program -> [(path, role)]
    as runtime_paths gives. One Hidden per path and hiding setting, naming every unit that
    hides it; in the order of `needs`.
    """
    found: dict[tuple[str, str, str, str, str], list[str]] = {}
    for name, text in units.items():
        hidden = hidden_dirs(text)
        for program in exec_programs(text):
            for path, role in needs.get(program, []):
                for d, option in hidden.items():
                    if path == d or path.startswith(d.rstrip("/") + "/"):
                        found.setdefault((program, path, role, d, option), []).append(name)
    order = [(program, path) for program, paths in needs.items() for path, _ in paths]
    return [Hidden(*key, units=tuple(names))
            for key, names in sorted(found.items(), key=lambda kv: order.index(kv[0][:2]))]


def runtime_paths(program: str) -> list[tuple[str, str]]:
    """(path, role) of the files `program` needs in order to start: itself and the file it
    links to; for a script its #! interpreter, the file that links to and a venv's base
    Python; when that interpreter is the one running now, where mariana is imported from
    (an editable install imports from its checkout)."""
    needs = [(program, ""), (os.path.realpath(program), "the file it links to")]
    interpreter = _interpreter(program)
    if interpreter:
        needs += [(interpreter, "its #! interpreter"),
                  (os.path.realpath(interpreter), f"the file its #! interpreter {interpreter} links to")]
        needs += _venv_base(interpreter)
        if Path(interpreter).parent.parent.resolve() == Path(sys.prefix).resolve():
            needs.append((str(Path(__file__).resolve().parents[1]), "the directory it imports mariana from"))
    first: dict[str, str] = {}  # a path once, with its first role (a script that is no link: itself)
    for path, role in needs:
        first.setdefault(path, role)
    return list(first.items())


def _interpreter(program: str) -> str | None:
    """The interpreter of a #! script: the #! path, env's argument as a unit's PATH finds it,
    or the python of pip's `#!/bin/sh` form for long paths, whose exec line names it; else None."""
    try:
        with open(program, "rb") as f:
            head = f.read(1024).decode("utf-8", "replace").splitlines()
    except OSError:
        return None  # not on this machine (a staging install): only its path is known
    if not head or not head[0].startswith("#!") or not head[0][2:].split():
        return None
    words = head[0][2:].split()
    if words[0] == "/bin/sh" and len(head) > 1 and head[1].startswith("'''exec' "):
        return shlex.split(head[1])[1]
    if os.path.basename(words[0]) == "env" and len(words) > 1:
        return shutil.which(words[-1], path=SYSTEMD_PATH) or words[-1]
    return words[0]


def _venv_base(interpreter: str) -> list[tuple[str, str]]:
    """A venv's python loads the standard library of the Python the venv was made from
    (pyvenv.cfg `home`), even when it is a copy rather than a link."""
    cfg = Path(interpreter).parent.parent / "pyvenv.cfg"
    try:
        lines = cfg.read_text().splitlines()
    except OSError:
        return []
    homes = [v.strip() for k, _, v in (line.partition("=") for line in lines) if k.strip() == "home"]
    if not homes:
        return []
    return [(homes[-1], f"pyvenv.cfg home of its venv {cfg.parent}: the Python whose standard library it loads")]


def _check_sandbox(plan: Plan, texts: dict[str, str], units_dir: Path, mariana: str, redis_server: str) -> None:
    """At / refuse, before anything is written, when a unit's sandbox hides what its program
    needs; under a staging prefix put it in the plan for the report."""
    units = {name: text + _dropins(units_dir / f"{name}.d") for name, text in texts.items()}
    programs = dict.fromkeys(p for text in units.values() for p in exec_programs(text))
    hidden = find_hidden(units, {p: runtime_paths(p) for p in programs})
    fixes = {h.program: _fix(h.program, {d for n in h.units for d in hidden_dirs(units[n])}, mariana, redis_server)
             for h in hidden}
    if hidden and os.path.realpath(plan.prefix) == "/":
        h = hidden[0]
        raise MarianaError(f"the units cannot run {h.program}: {_explain(h)}; {fixes[h.program]}")
    plan.hidden = [f"{h.program}: {_explain(h)}" for h in hidden]
    plan.fixes = list(fixes.values())


def _dropins(d: Path) -> str:
    """A unit's drop-ins (UNIT.d/*.conf), in the order systemd applies them."""
    try:
        return "".join("\n" + p.read_text() for p in sorted(d.glob("*.conf")))
    except OSError as e:
        raise MarianaError(f"{d}: cannot read it: {e.strerror}") from None


def _explain(h: Hidden) -> str:
    subject = "it is" if not h.role else f"it needs {h.path} ({h.role}),"
    units = h.units[0] if len(h.units) == 1 else f"{h.units[0]} and {len(h.units) - 1} more units"
    return f"{subject} under {h.under}, which {h.option} hides from {units}"


def _fix(program: str, dirs: set[str], mariana: str, redis_server: str) -> str:
    ordered = sorted(dirs)
    outside = f"{', '.join(ordered[:-1])} and {ordered[-1]}" if len(ordered) > 1 else ordered[0]
    if program == mariana:
        return (f"create the venv from a system Python outside {outside}, such as Debian's /usr/bin/python3: "
                "`/usr/bin/python3 -m venv /opt/mariana/.venv && /opt/mariana/.venv/bin/pip install "
                "torch==2.13.0 /path/to/mariana`, then run `/opt/mariana/.venv/bin/mariana deploy install`; "
                "or pass --mariana PATH of an install laid out so (docs/operations.md)")
    if program == redis_server:
        return (f"use a redis-server outside {outside}: `apt-get install redis-server` and "
                "--redis-server /usr/bin/redis-server, or a copy under /opt/mariana and --redis-server PATH")
    return f"move {program} outside {outside}, or change the unit's setting in a drop-in"


def _add(plan: Plan, dest: Path, text: str, replace: bool) -> None:
    if dest.is_symlink() and os.path.realpath(dest) == os.devnull:  # masked: an admin turned it off on this host
        plan.masked.append(dest)
        return
    if dest.exists() and not dest.is_file():  # found before anything is written (it stopped the install midway)
        raise MarianaError(f"{dest}: {'a directory' if dest.is_dir() else 'not a regular file'} where the install "
                           "writes a file; remove it, or install under another --prefix")
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
    from mariana.services.runtime.config import load_cluster_config

    config = cluster_toml if cluster_toml in plan.kept + plan.unchanged else plan.source / "config/cluster.systemd.toml"
    try:
        cfg = load_cluster_config(config, env={})
    except MarianaError as e:
        raise MarianaError(f"{config}: {e}") from None
    masked = {p.name for p in plan.masked}  # (an instance of a masked template is masked too)
    units = [f"{name}.service" for name in SINGLE if f"{name}.service" not in masked]
    for template, role in TEMPLATES:
        units += [f"{template}{i}.service" for i in range(cfg.count(role)) if f"{template}.service" not in masked]
    units += ["mariana-serve.service"] * ("mariana-serve.service" not in masked)
    etc = "/etc/mariana"
    return ["id -u mariana >/dev/null 2>&1 || useradd --system --home-dir /var/lib/mariana "
            "--shell /usr/sbin/nologin mariana",
            "install -d -o mariana -g mariana -m 0750 /var/lib/mariana /var/lib/mariana/models /var/lib/mariana/logs",
            "chgrp mariana " + " ".join(f"{etc}/{name}" for name in SECRET),
            "systemctl daemon-reload",
            "systemctl enable --now mariana.target " + " ".join(units),
            *(["systemctl enable --now mariana-retrain.timer"] if "mariana-retrain.timer" not in masked else [])]


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
    lines += [f"{'masked':>12}  {p} (linked to /dev/null: `systemctl mask`; left so, and not started)"
              for p in plan.masked]
    for p in plan.kept:
        src = next(plan.source / s for s, name in CONFIGS.items() if name == p.name)
        lines.append(f"{'kept':>12}  {p} (it exists and may be edited: not overwritten; the shipped one is {src})")
    lines.append("")
    if plan.prefix != Path("/"):
        lines.append(f"The files are under {plan.prefix}; on the host they go to the same paths under /.")
    lines.append("Then, as root:" if not dry_run else "After installing, as root:")
    lines += [f"  {c}" for c in plan.commands]
    if plan.hidden:  # last, where it is seen; at / the install refuses this
        lines += ["", "WARNING: on a host laid out like this one these units will not start: their sandbox "
                  "hides files they need (`mariana deploy install` at / refuses this).",
                  *(f"  {line}" for line in plan.hidden), "Fix:", *(f"  {fix}" for fix in plan.fixes)]
    return "\n".join(lines)


def install(prefix: str = "/", dry_run: bool = False, mariana: str | None = None,
            redis_server: str | None = None) -> str:
    plan = plan_install(prefix, mariana, redis_server)
    if not dry_run:
        apply(plan)
    return report(plan, dry_run)
