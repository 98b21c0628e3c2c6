"""deploy/: `mariana deploy install` writes the units and configs and prints what
to run; the units it writes pass `systemd-analyze verify` (templates as
instances, the target, the timer); the configs, the Redis config and the
Prometheus scrape config agree on the ports."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mariana.services.deploy import Hidden, find_hidden, hidden_dirs, runtime_paths
from mariana.services.runtime.config import load_cluster_config
from mariana.services.runtime.lifecycle import DRAIN_SECONDS
from tests.conftest import ROOT, run_cli
from tests.debian import debian_tool

DEPLOY = ROOT / "deploy"
UNITS = sorted(p.name for p in (DEPLOY / "systemd").iterdir() if p.suffix in (".service", ".timer", ".target"))
CONFIGS = ("cluster.toml", "serve.toml", "redis.conf", "prometheus.yml")
LONG_RUNNING = ("mariana-coordinator.service", "mariana-loader.service", "mariana-preprocess@.service",
                "mariana-worker@.service", "mariana-ps@.service", "mariana-serve.service")
HARDENING = ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "PrivateDevices=yes",
             "ProtectKernelTunables=yes", "ProtectKernelModules=yes", "ProtectControlGroups=yes",
             "RestrictSUIDSGID=yes", "LockPersonality=yes")
MARIANA = str(Path(sys.executable).parent / "mariana")
SANDBOXED = ("/home", "/root", "/run/user", "/tmp", "/var/tmp")  # what ProtectHome=yes and PrivateTmp=yes hide
RUN_MARIANA = [n for n in UNITS if "ExecStart=/opt/mariana/.venv/bin/mariana " in (DEPLOY / "systemd" / n).read_text()]


def error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def settings(text: str) -> dict[str, list[str]]:
    """Key -> values of a unit file (keys may repeat)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(s|min)?", value)
    assert m, value
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


@pytest.fixture(scope="session")
def systemd_analyze() -> str:
    """systemd-analyze, installed from Debian's `systemd` package when it is missing."""
    return debian_tool("systemd-analyze", "systemd", timeout=600)


# ---- the units ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", LONG_RUNNING)
def test_long_running_units_notify_restart_and_are_sandboxed(name):
    s = settings((DEPLOY / "systemd" / name).read_text())
    one = {k: v[-1] for k, v in s.items()}
    assert (one["Type"], one["NotifyAccess"], one["Restart"]) == ("notify", "main", "on-failure"), name
    assert 0 < seconds(one["WatchdogSec"]) <= 60 and seconds(one["RestartSec"]) > 0
    if name == "mariana-serve.service":  # the supervisor waits drain_seconds + 10 s for its workers
        from mariana.serving.config import load_serve_config

        assert seconds(one["TimeoutStopSec"]) > load_serve_config(None, {}).serve.drain_seconds + 10
    else:  # drain, then the main task's bounded cleanup, then close (a shard's checkpoint)
        assert seconds(one["TimeoutStopSec"]) > 2 * DRAIN_SECONDS + 30, name
    assert seconds(one["TimeoutStartSec"]) > load_cluster_config(env={}).cluster.start_seconds
    assert (one["User"], one["Group"], one["PartOf"], one["WantedBy"]) == ("mariana", "mariana", "mariana.target",
                                                                           "mariana.target")
    assert one["ExecStart"].startswith("/opt/mariana/.venv/bin/mariana ")
    assert "/etc/mariana/" in one["ExecStart"] and one.get("StateDirectory") == "mariana"
    assert set(one["RestrictAddressFamilies"].split()) >= {"AF_INET", "AF_INET6", "AF_UNIX"}
    assert all(h in (DEPLOY / "systemd" / name).read_text().splitlines() for h in HARDENING), name
    if name.endswith("@.service"):
        assert one["ExecStart"].endswith("--index %i")


def test_the_target_and_the_redis_unit():
    target = settings((DEPLOY / "systemd" / "mariana.target").read_text())
    assert target["WantedBy"] == ["multi-user.target"]
    redis = settings((DEPLOY / "systemd" / "mariana-redis.service").read_text())
    assert redis["ExecStart"] == ["/usr/bin/redis-server /etc/mariana/redis.conf"]
    assert redis["PartOf"] == redis["WantedBy"] == ["mariana.target"]
    for name in ("mariana-coordinator.service", "mariana-worker@.service"):
        assert "mariana-redis.service" in settings((DEPLOY / "systemd" / name).read_text())["After"][0]


def test_units_verify(tmp_path, systemd_analyze):
    """What `mariana deploy install` writes verifies: each unit, and each template as an instance."""
    proc = run_cli("deploy", "install", "--prefix", tmp_path, check=True)
    units = tmp_path / "etc" / "systemd" / "system"
    for path in units.iterdir():  # systemd-analyze of some versions wants the user to exist
        path.write_text(path.read_text().replace("User=mariana", "User=root").replace("Group=mariana", "Group=root"))
    names = [n.replace("@.", "@0.") for n in UNITS] + ["mariana-worker@1.service"]
    assert {"mariana-worker@0.service", "mariana.target", "mariana-retrain.timer"} <= set(names), proc.stdout
    verify = subprocess.run([systemd_analyze, "verify", *(str(units / n) for n in names)],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0 and not verify.stderr.strip(), verify.stderr


def test_verify_catches_a_broken_unit(tmp_path, systemd_analyze):
    """The check above can fail: a unit whose ExecStart is missing does not verify."""
    text = (DEPLOY / "systemd" / "mariana-worker@.service").read_text()
    (tmp_path / "mariana-worker@.service").write_text(text.replace("User=mariana", "User=root")
                                                      .replace("Group=mariana", "Group=root"))
    shutil.copy(DEPLOY / "systemd" / "mariana.target", tmp_path)
    verify = subprocess.run([systemd_analyze, "verify", str(tmp_path / "mariana-worker@0.service")],
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode != 0 and "/opt/mariana/.venv/bin/mariana" in verify.stderr, verify.stderr


# ---- mariana deploy install ------------------------------------------------------------------

def test_dry_run_writes_nothing_and_lists_what_it_would(tmp_path):
    proc = run_cli("deploy", "install", "--prefix", tmp_path / "root", "--dry-run", check=True)
    assert not (tmp_path / "root").exists()
    for name in UNITS:
        assert f"would write  {tmp_path / 'root/etc/systemd/system' / name}" in proc.stdout
    for name in CONFIGS:
        assert f"would write  {tmp_path / 'root/etc/mariana' / name}" in proc.stdout


def test_install_writes_units_and_configs_and_says_what_to_run(tmp_path):
    proc = run_cli("deploy", "install", "--prefix", tmp_path, check=True)
    units, etc = tmp_path / "etc/systemd/system", tmp_path / "etc/mariana"
    assert sorted(p.name for p in units.iterdir()) == UNITS
    assert sorted(p.name for p in etc.iterdir()) == sorted(CONFIGS)
    worker = (units / "mariana-worker@.service").read_text()
    assert f"ExecStart={MARIANA} run worker --config /etc/mariana/cluster.toml --index %i" in worker
    assert "/opt/mariana/.venv" not in "".join(p.read_text() for p in units.iterdir())
    # Documentation= names this install's README (it named /opt/mariana/deploy/README.md, never written)
    assert f"Documentation={(DEPLOY / 'README.md').as_uri()}" in worker and (DEPLOY / "README.md").is_file()
    # the shipped config, with an admin token of its own (any local user could submit jobs without one)
    written, shipped = (etc / "cluster.toml").read_text(), (DEPLOY / "config/cluster.systemd.toml").read_text()
    token = load_cluster_config(etc / "cluster.toml", env={}).coordinator.token
    assert len(token) == 32 and written == shipped.replace('token = ""', f'token = "{token}"', 1)
    run_cli("deploy", "install", "--prefix", tmp_path / "again", check=True)
    assert load_cluster_config(tmp_path / "again/etc/mariana/cluster.toml", env={}).coordinator.token != token
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in etc.iterdir()}
    assert modes == {"cluster.toml": "0o640", "serve.toml": "0o640", "redis.conf": "0o640",  # tokens
                     "prometheus.yml": "0o644"}, modes
    lines = proc.stdout.splitlines()
    assert "  systemctl daemon-reload" in lines
    assert "  systemctl enable --now mariana-retrain.timer" in lines
    assert any("useradd --system --home-dir /var/lib/mariana" in ln for ln in lines)
    enable = next(ln for ln in lines if ln.startswith("  systemctl enable --now mariana.target"))
    cfg = load_cluster_config(DEPLOY / "config/cluster.systemd.toml", env={})
    for role in ("worker", "ps", "preprocess"):  # one instance per index the config counts
        assert [u for u in enable.split() if u.startswith(f"mariana-{role}@")] == \
            [f"mariana-{role}@{i}.service" for i in range(cfg.count(role))], enable
    assert {"mariana-coordinator.service", "mariana-loader.service", "mariana-serve.service"} <= set(enable.split())


def test_a_second_install_keeps_an_edited_config_and_follows_its_counts(tmp_path):
    run_cli("deploy", "install", "--prefix", tmp_path, "--mariana", "/srv/venv/bin/mariana", check=True)
    cluster, unit = tmp_path / "etc/mariana/cluster.toml", tmp_path / "etc/systemd/system/mariana-loader.service"
    cluster.write_text(cluster.read_text().replace("[worker]\ncount = 2", "[worker]\ncount = 3"))
    assert "/srv/venv/bin/mariana run loader" in unit.read_text()
    proc = run_cli("deploy", "install", "--prefix", tmp_path, check=True)
    assert "[worker]\ncount = 3" in cluster.read_text()
    assert f"kept  {cluster} (it exists and may be edited: not overwritten" in proc.stdout
    assert f"wrote  {unit}" in proc.stdout and f"{MARIANA} run loader" in unit.read_text()  # units follow the package
    assert "mariana-worker@2.service" in proc.stdout


def test_bad_input_exits_2_with_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    line = error_line(run_cli("deploy", "install", "--prefix", afile))
    assert line == f"mariana: error: {afile}/etc/mariana: cannot write there: {afile} is not a directory"
    assert not list(tmp_path.glob("afile*/**"))
    assert "unrecognized arguments: --bogus" in error_line(run_cli("deploy", "install", "--bogus"))
    broken = tmp_path / "broken"
    (broken / "etc/mariana").mkdir(parents=True)
    (broken / "etc/mariana/cluster.toml").write_text("[worker]\ncount = 0\n")
    line = error_line(run_cli("deploy", "install", "--prefix", broken))
    assert "cluster.toml" in line and "worker.count must be in 1..4,096" in line
    assert not (broken / "etc/systemd").exists()  # checked before anything is written


def test_a_masked_unit_stays_masked_and_a_directory_in_a_files_place_stops_the_install_before_it_writes(tmp_path):
    """A second install replaced a unit masked on this host (linked to /dev/null) with the unit
    and printed the line that started it; a directory named like a config was found after the
    units were written (exit 2, half an install), and --dry-run said it would write it."""
    run_cli("deploy", "install", "--prefix", tmp_path, check=True)
    units = tmp_path / "etc/systemd/system"
    for name in ("mariana-serve.service", "mariana-worker@.service"):
        (units / name).unlink()
        (units / name).symlink_to("/dev/null")
    proc = run_cli("deploy", "install", "--prefix", tmp_path, check=True)
    assert (units / "mariana-serve.service").is_symlink() and (units / "mariana-worker@.service").is_symlink()
    assert f"masked  {units / 'mariana-serve.service'} (linked to /dev/null" in proc.stdout
    enable = next(line for line in proc.stdout.splitlines() if "enable --now mariana.target" in line)
    assert "mariana-serve.service" not in enable and "mariana-worker@" not in enable and "mariana-ps@0" in enable
    other = tmp_path / "other"
    (other / "etc/mariana/serve.toml").mkdir(parents=True)
    for dry in (["--dry-run"], []):
        line = error_line(run_cli("deploy", "install", "--prefix", other, *dry))
        assert line == (f"mariana: error: {other}/etc/mariana/serve.toml: a directory where the install writes a "
                        "file; remove it, or install under another --prefix"), line
    assert not (other / "etc/systemd").exists() and not (other / "etc/mariana/cluster.toml").exists()


# ---- the sandbox hides nothing the units need -------------------------------------------------

def test_hidden_dirs_follow_what_the_unit_says():
    shipped = (DEPLOY / "systemd" / "mariana-worker@.service").read_text()
    assert hidden_dirs(shipped) == {d: "PrivateTmp=yes" if "tmp" in d else "ProtectHome=yes" for d in SANDBOXED}
    assert hidden_dirs(shipped + "\n[Service]\nProtectHome=read-only\nPrivateTmp=no\n") == {}  # a drop-in
    assert hidden_dirs("ProtectHome=tmpfs\nPrivateTmp=false") == dict.fromkeys(SANDBOXED[:3], "ProtectHome=tmpfs")
    listed = "InaccessiblePaths=/srv\nInaccessiblePaths=\nInaccessiblePaths=-/data/ /x\nTemporaryFileSystem=/var:ro"
    assert hidden_dirs(listed) == {"/data": "InaccessiblePaths=-/data/", "/x": "InaccessiblePaths=/x",
                                   "/var": "TemporaryFileSystem=/var:ro"}  # the empty one cleared /srv


def unit(program: str, extra: str = "") -> str:
    return f"[Service]\nExecStart={program} run worker\nProtectHome=yes\nPrivateTmp=yes\n{extra}"


def test_a_venv_under_opt_from_a_system_python_is_visible():
    opt = "/opt/mariana/.venv/bin/mariana"
    needs = {opt: [(opt, ""), ("/opt/mariana/.venv/bin/python", "its #! interpreter"),
                   ("/usr/bin/python3.11", "the file its #! interpreter links to"), ("/usr/bin", "pyvenv.cfg home")]}
    assert find_hidden({"a.service": unit(opt), "b.service": unit(opt)}, needs) == []


def test_a_venv_under_opt_from_a_python_under_root_is_not():
    """A venv's bin/python links to the Python it was made from: pyenv's, under /root, is hidden."""
    opt, base = "/opt/mariana/.venv/bin/mariana", "/root/.pyenv/versions/3.11.7/bin"
    needs = {opt: [(opt, ""), ("/opt/mariana/.venv/bin/python", "its #! interpreter"),
                   (f"{base}/python3.11", "the file its #! interpreter links to"), (base, "pyvenv.cfg home")],
             "/tmp/redis-server": [("/tmp/redis-server", "")]}
    units = {"a.service": unit(opt), "b.service": unit(opt, "ProtectHome=read-only\n"),  # as with a drop-in
             "c.service": unit(opt), "redis.service": unit("/tmp/redis-server"), "d.timer": "[Timer]\nOnCalendar=daily"}
    assert find_hidden(units, needs) == [
        Hidden(opt, f"{base}/python3.11", "the file its #! interpreter links to", "/root", "ProtectHome=yes",
               ("a.service", "c.service")),
        Hidden(opt, base, "pyvenv.cfg home", "/root", "ProtectHome=yes", ("a.service", "c.service")),
        Hidden("/tmp/redis-server", "/tmp/redis-server", "", "/tmp", "PrivateTmp=yes", ("redis.service",))]


def test_runtime_paths_follow_the_script_its_interpreter_and_the_venv(tmp_path):
    base, venv = tmp_path / "base" / "bin", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    base.mkdir(parents=True)
    (base / "python3.11").write_text("")
    (venv / "bin" / "python").symlink_to(base / "python3.11")
    (venv / "pyvenv.cfg").write_text(f"home = {base}\ninclude-system-site-packages = false\n")
    script = venv / "bin" / "mariana"
    script.write_text(f"#!{venv}/bin/python\nimport sys\n")
    assert runtime_paths(str(script)) == [
        (str(script), ""), (f"{venv}/bin/python", "its #! interpreter"),
        (str(base / "python3.11"), f"the file its #! interpreter {venv}/bin/python links to"),
        (str(base), f"pyvenv.cfg home of its venv {venv}: the Python whose standard library it loads")]
    long = tmp_path / "long"  # pip's form for an interpreter path too long (or spaced) for #!
    long.write_text("#!/bin/sh\n'''exec' \"/opt/a b/bin/python\" \"$0\" \"$@\"\n' '''\nimport sys\n")
    assert runtime_paths(str(long))[1] == ("/opt/a b/bin/python", "its #! interpreter")
    assert runtime_paths("/nowhere/bin/mariana") == [("/nowhere/bin/mariana", "")]  # another host's: its path only


def test_install_at_root_refuses_what_the_sandbox_hides_before_writing():
    """--dry-run at / (nothing written either way): the check runs in the plan, before any write."""
    home = "/home/alice/mariana/.venv/bin/mariana"
    line = error_line(run_cli("deploy", "install", "--dry-run", "--mariana", home,
                              "--redis-server", "/usr/bin/redis-server"))
    assert line.startswith(f"mariana: error: the units cannot run {home}: it is under /home, which ProtectHome=yes "
                           f"hides from mariana-coordinator.service and {len(RUN_MARIANA) - 1} more units; create "
                           "the venv from a system Python outside /home, /root, /run/user, /tmp and /var/tmp"), line
    assert "`/usr/bin/python3 -m venv /opt/mariana/.venv && /opt/mariana/.venv/bin/pip install" in line
    assert line.endswith("or pass --mariana PATH of an install laid out so (docs/operations.md)")
    line = error_line(run_cli("deploy", "install", "--dry-run", "--mariana", "/opt/mariana/.venv/bin/mariana",
                              "--redis-server", "/var/tmp/redis-server"))
    assert line == ("mariana: error: the units cannot run /var/tmp/redis-server: it is under /var/tmp, which "
                    "PrivateTmp=yes hides from mariana-redis.service; use a redis-server outside /home, /root, "
                    "/run/user, /tmp and /var/tmp: `apt-get install redis-server` and --redis-server "
                    "/usr/bin/redis-server, or a copy under /opt/mariana and --redis-server PATH")


def test_a_staging_install_writes_and_warns(tmp_path):
    script = tmp_path / "mariana"
    script.write_text("#!/home/alice/.venv/bin/python\n")
    assert f"cannot run {script}: " in error_line(run_cli("deploy", "install", "--dry-run", "--mariana", script))
    proc = run_cli("deploy", "install", "--prefix", tmp_path / "root", "--mariana", script,
                   "--redis-server", "/usr/bin/redis-server", check=True)
    assert f"ExecStart={script} run loader" in (tmp_path / "root/etc/systemd/system/mariana-loader.service").read_text()
    warning = proc.stdout[proc.stdout.index("\nWARNING: "):].splitlines()
    assert warning[1].startswith("WARNING: on a host laid out like this one these units will not start")
    assert (f"  {script}: it needs /home/alice/.venv/bin/python (its #! interpreter), under /home, which "
            f"ProtectHome=yes hides from mariana-coordinator.service and {len(RUN_MARIANA) - 1} more units") in warning
    assert warning[-2] == "Fix:" and warning[-1].startswith("  create the venv from a system Python outside /home")


def test_drop_ins_are_read_and_a_visible_layout_warns_nothing(tmp_path):
    opt = run_cli("deploy", "install", "--prefix", tmp_path, "--mariana", "/opt/mariana/.venv/bin/mariana",
                  "--redis-server", "/usr/bin/redis-server", check=True)
    assert "WARNING" not in opt.stdout
    home = "/home/alice/.venv/bin/mariana"
    for name in RUN_MARIANA:  # the operator's choice, in files systemd reads
        (tmp_path / f"etc/systemd/system/{name}.d").mkdir()
        (tmp_path / f"etc/systemd/system/{name}.d/home.conf").write_text("[Service]\nProtectHome=read-only\n")
    args = ("deploy", "install", "--prefix", tmp_path, "--mariana", home, "--redis-server", "/usr/bin/redis-server")
    assert "WARNING" not in run_cli(*args, check=True).stdout
    (tmp_path / "etc/systemd/system/mariana-serve.service.d/home.conf").unlink()
    proc = run_cli(*args, check=True)
    assert f"  {home}: it is under /home, which ProtectHome=yes hides from mariana-serve.service\n" in proc.stdout


# ---- the configs agree on ports --------------------------------------------------------------

def test_systemd_configs_redis_and_prometheus_agree_on_ports():
    from mariana.serving.config import load_serve_config

    cfg = load_cluster_config(DEPLOY / "config/cluster.systemd.toml", env={})
    assert cfg.cluster.base_port and not cfg.redis.embedded and cfg.cluster.host == "127.0.0.1"
    redis_conf = (DEPLOY / "config/redis.conf").read_text()
    assert f"\nport {cfg.redis.url.rsplit(':', 1)[1].split('/')[0]}\n" in redis_conf
    assert "\nbind 127.0.0.1\n" in redis_conf and '\nsave ""\n' in redis_conf
    serve = load_serve_config(DEPLOY / "config/serve.systemd.toml", {})
    assert serve.serve.redis_url == cfg.redis.url and serve.serve.model_dir.startswith("/var/lib/mariana/")
    scraped = re.findall(r'"127\.0\.0\.1:(\d+)"', (DEPLOY / "prometheus/prometheus.yml").read_text())
    expected = [cfg.coordinator.http_port, cfg.loader.metrics_port, *cfg.ps.metrics_ports,
                *cfg.preprocess.metrics_ports, *cfg.worker.metrics_ports, serve.serve.port]
    assert sorted(map(int, scraped)) == sorted(expected)


@pytest.mark.parametrize("args,says", [
    (("--mariana", "relative/mariana"), "--mariana 'relative/mariana': give an absolute path"),
    (("--mariana", "/opt/my mariana/bin/mariana"), "a path with whitespace splits ExecStart="),
    (("--redis-server", "bin/redis-server"), "--redis-server 'bin/redis-server': give an absolute path"),
    # written with exit 0 before: %n became the unit's name, a quote unbalanced ExecStart=, a backslash was fatal
    (("--mariana", "/opt/o%n/bin/mariana"), "--mariana '/opt/o%n/bin/mariana': % in a path means something else"),
    (("--redis-server", "/opt/it's/redis-server"), "' in a path means something else in ExecStart="),
    (("--mariana", "/opt/a\\b/mariana"), "\\ in a path means something else in ExecStart="),
    (("--prefix", ""), "--prefix is empty"),
    # at /: this host's layout (a redis-server the sandbox lets run: a checkout's own may sit under /tmp)
    (("--mariana", "/nope/mariana", "--redis-server", "/bin/sh"),
     "--mariana /nope/mariana: does not exist (an executable file) on this host: every unit that runs it would fail"),
    (("--mariana", "/usr/bin", "--redis-server", "/bin/sh"),
     "--mariana /usr/bin: is not a file (an executable file) on this host"),
])
def test_programs_the_units_cannot_run_are_refused(args, says):
    """systemd-analyze verify calls these units fatal: refused before anything is written."""
    assert says in error_line(run_cli("deploy", "install", "--dry-run", *args))
