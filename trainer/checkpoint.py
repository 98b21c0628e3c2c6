"""Versioned model directories of plain records: safetensors arrays + a JSON manifest.

    MODEL_DIR/
      CURRENT                  name of the version in service ("v000002")
      v000001/
        manifest.json          format, model + hashing + schema config, metrics, ...
        weights.safetensors    dense parameters and the touched rows of each table
        optimizer.safetensors  optimizer state (to resume training)
      v000002/ ...
      HIGHEST_VERSION          the highest version name ever given here: one deleted is not given again
      promotions.jsonl         one line per move of CURRENT: time, from, to, reason
      decisions.jsonl          one line per retrain verdict (serving/retrain.py)
      .pruned-v000001-PID/     a version `prune` is removing (renamed aside, then deleted)
      .tmp-HOST-PID-XXXX/      a version being written (its writer holds an flock on it)

A version is written into a hidden temp dir, fsynced, renamed into place
atomically, and only then does `CURRENT` move (by an atomic rename too), so a
reader never sees a half-written version. What a writer killed midway leaves (a temp
dir no one holds, a `.CURRENT.PID` file) is removed by the next save and by `prune`
(`sweep_debris`). Once CURRENT has moved nothing undoes the move, and a move left
unrecorded is reconciled from the record (`_unrecorded_move`). `prune` removes old versions the same way
round: renamed aside to a hidden name, then deleted. The lines of promotions.jsonl and
decisions.jsonl stay: they are history, and may name versions no longer here.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from mariana.sparse import finite
from mariana.sparse.errors import ModelDirError
from mariana.sparse.files import DIGESTS, DISK_FULL, check_digests, file_digests, loads_json, manifest_sha256, why

log = logging.getLogger(__name__)

FORMAT = "mariana-model/1"
VERSION_RE = re.compile(r"^v(\d{6,})$")
WEIGHTS = "weights.safetensors"
OPTIMIZER = "optimizer.safetensors"
MANIFEST = "manifest.json"
PROMOTIONS = "promotions.jsonl"
DECISIONS = "decisions.jsonl"
HIGHEST = "HIGHEST_VERSION"
PRUNED = ".pruned-"  # a version being removed by `prune`: `.pruned-v000003-<pid>`
PRUNED_RE = re.compile(r"^\.pruned-v\d{6,}-\d+$")
TMP = ".tmp-"  # a version being written: `.tmp-<host>-<pid>-<random>` (before: `.tmp-<random>`)
_HOST = os.uname().nodename.replace("-", "_")
# what a writer killed midway leaves: its temp version dir, CURRENT or HIGHEST_VERSION temp file, a dir set aside
_TMP_RE = re.compile(r"^\.tmp-(?:[^-]+-\d+-)?\w+$")  # a version being written (a writer's, or older: nameless)
_MOVE_RE = re.compile(r"^\.(?:CURRENT|HIGHEST_VERSION)\.\d+$")  # set_current's and _record_highest's temp file
UNLOCKED_S = 60.0  # a temp version dir its writer has not held locked this long is left over


def list_versions(model_dir: str | os.PathLike) -> list[str]:
    """Version names in ascending order."""
    d = Path(model_dir)
    if not d.is_dir():
        return []
    return sorted((p.name for p in d.iterdir() if VERSION_RE.match(p.name) and p.is_dir()),
                  key=lambda n: int(VERSION_RE.match(n).group(1)))


def require_version(model_dir: str | os.PathLike, version: str, purpose: str = "") -> None:
    """ModelDirError unless `version` names a version directory of `model_dir`, in the one
    wording every command uses; `purpose` ("to warm-start from") follows the version named.

    >>> try:
    ...     require_version("/nonexistent", "v000001")
    ... except ModelDirError as e:
    ...     print(e)
    /nonexistent: no such model directory
    """
    d = Path(model_dir)
    if not d.is_dir():
        raise ModelDirError(f"{model_dir}: {'not a directory' if d.exists() else 'no such model directory'}")
    if VERSION_RE.match(version) and (d / version).is_dir():
        return
    have = list_versions(d)
    shown = ", ".join(have) if len(have) <= 6 else f"{', '.join(have[:2])}, ... {', '.join(have[-3:])}; " \
        f"{len(have)} in all"
    raise ModelDirError(f"{model_dir}: no version {version!r}{' ' + purpose if purpose else ''} "
                        f"(versions: {shown or 'none'}; 'mariana model list' shows them)")


def current_version(model_dir: str | os.PathLike) -> str:
    d = Path(model_dir)
    if not d.exists():
        raise ModelDirError(f"{model_dir}: no such model directory")
    if not d.is_dir():
        raise ModelDirError(f"{model_dir}: not a directory")
    try:
        raw = (d / "CURRENT").read_bytes()
    except FileNotFoundError:
        if VERSION_RE.match(d.resolve().name) and (d / MANIFEST).is_file():  # a version's own dir, named as a model's
            raise ModelDirError(f"{model_dir}: a version's directory, not a model directory: name the model "
                                f"directory ({d.resolve().parent}), whose CURRENT says which version serves") from None
        versions = list_versions(d)
        if versions:  # candidates a retrain gate kept (promote false), or a CURRENT deleted by hand
            shown = ", ".join(versions[-3:]) + (f" (and {len(versions) - 3} older)" if len(versions) > 3 else "")
            raise ModelDirError(f"{model_dir}: no CURRENT file, so no version serves; it holds {shown}: pick one "
                                f"with 'mariana model promote VERSION --model-dir {model_dir}'") from None
        if _is_featurizer(d):  # mariana featurizer train's, train image's: no versions
            raise ModelDirError(f"{model_dir}: an image featurizer, not a model directory: 'mariana featurize "
                                f"--model {model_dir}' runs it") from None
        raise ModelDirError(f"{model_dir}: holds no model (no CURRENT file); train one with 'mariana train'") from None
    except OSError as e:
        raise ModelDirError(f"{d / 'CURRENT'}: cannot read it: {e.strerror or e}") from None
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:  # a damaged file: its bytes shown as they are
        raise ModelDirError(f"{model_dir}: CURRENT is not text ({raw[:40]!r}), so it names no version here") from None
    if not VERSION_RE.match(name) or not (d / name).is_dir():  # NUL bytes, a garbled file: no version name
        raise ModelDirError(f"{model_dir}: CURRENT names {name!r}, which is not a version here")
    return name


def named_version(model_dir: str | os.PathLike) -> str | None:
    """The version name CURRENT holds, whether or not that version is still here (a version
    deleted by hand); None when CURRENT is missing, unreadable or holds no version name."""
    try:
        name = (Path(model_dir) / "CURRENT").read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if VERSION_RE.match(name) else None


def _is_featurizer(d: Path) -> bool:
    try:
        manifest = loads_json((d / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and str(manifest.get("format", "")).startswith("mariana-featurizer")


def resolved(model_dir: str | os.PathLike) -> Path:
    """The directory a model dir names, a symlink followed once: a command that changes it
    (save, promote, prune) works in one directory. Following a blue/green link anew at each
    step, a prune switched mid-way removed the other directory's CURRENT version, and a
    promote wrote its journal line into the other directory. (A server follows the link at
    each poll: that is how it takes a switch.)"""
    return Path(os.path.realpath(model_dir))


class CurrentMoved(ModelDirError):
    """`set_current(..., expect=V)` found CURRENT naming another version than V (`found`)."""

    def __init__(self, message: str, found: str | None):
        super().__init__(message)
        self.found = found


_ANY = object()


def set_current(model_dir: str | os.PathLike, version: str, reason: str | None = None,
                expect: str | None | object = _ANY) -> str | None:
    """Point CURRENT at `version`; returns the version it named before (None: none). A
    `model_dir` that is a symlink is resolved once (`resolved`).
    With a `reason` ("trained", "promoted", "rollback", ...) the move is recorded in
    promotions.jsonl, which `rollback_target` reads. With `expect` (a version, or None for
    no CURRENT), CURRENT moves only if it still names that: otherwise CurrentMoved, and
    nothing changes. Moves of one model dir take turns (a lock on the directory itself, so
    no file is left behind): a check and its move are one step for every process."""
    d = resolved(model_dir)
    if not VERSION_RE.match(version):  # a path or "." would leave CURRENT naming no version of this dir
        raise ModelDirError(f"{model_dir}: {version!r} is not a version name (v000001, ...: see 'mariana model list')")
    require_version(d, version)
    with _locked(d):
        return _move_current(d, version, reason, expect, model_dir)


def _move_current(d: Path, version: str, reason: str | None, expect: str | None | object = _ANY,
                  model_dir: str | os.PathLike | None = None) -> str | None:
    """set_current's move, the caller holding the dir's lock (`model_dir`: as the caller named it)."""
    model_dir = d if model_dir is None else model_dir
    before = named_version(d)  # current_version's name, or a version deleted while it served
    if expect is not _ANY and before is None and not (d / "CURRENT").exists() and expect == last_moved_to(d):
        before = expect  # CURRENT deleted: the servers serve what it was last moved to, `expect` among them
    if expect is not _ANY and before != expect:  # first: a prune after that move may have removed `version`
        raise CurrentMoved(f"{model_dir}: CURRENT names {before or 'no version'}, not {expect or 'no version'} "
                           "(another promotion moved it); it was left as it is", before)
    if not (d / version).is_dir():  # again, under the lock: a prune may have removed it since
        raise ModelDirError(f"{model_dir}: no version {version!r} (removed meanwhile); CURRENT was left as it is")
    tmp = d / f".CURRENT.{os.getpid()}"
    try:
        tmp.write_text(version + "\n")
        fsync_file(tmp)
        os.replace(tmp, d / "CURRENT")
    except OSError as e:
        with contextlib.suppress(OSError):  # a read-only filesystem refuses this too: the first error says why
            tmp.unlink(missing_ok=True)
        raise ModelDirError(f"{model_dir}: cannot move CURRENT to {version}: {_why(e, d)}; CURRENT still names "
                            f"{before or 'no version'}") from None
    # CURRENT has moved: from here on nothing undoes it, and what fails is a warning
    _sync_after_rename(d, f"CURRENT moved {before} -> {version}")
    if reason is not None and before != version:
        moves = promotions(d)
        missing = _unrecorded_move(moves, before)
        if missing is not None:  # killed before its line, a line a full disk refused, CURRENT edited by hand
            _record_move(d, *missing)
        # CURRENT missing or garbled (a path, NUL bytes): the servers served the version it was
        # last moved to (serving/watch.py), and a rollback from this move goes back to that
        served = before if before is not None or not moves else moves[-1]["to"]
        if served != version:
            _record_move(d, served, version, reason)
    return before


LEARNED_MOST = 1000  # data files a manifest's parent lists as learned before it


def learned_paths(manifest: dict) -> list[str]:
    """The data files a version learned from: its own (train.data) and, as its manifest's
    parent records them, its warm-start ancestors' (at most LEARNED_MOST), so that what they
    learned is known after a prune removed them (a retrain's eval window must not hold it).

    >>> learned_paths({"train": {"data": ["/d/day3.tsv"]}, "parent": {"learned": ["/d/day2.tsv", "/d/day1.tsv"]}})
    ['/d/day3.tsv', '/d/day2.tsv', '/d/day1.tsv']
    """
    train, parent = manifest.get("train"), manifest.get("parent")
    own = train.get("data") if isinstance(train, dict) else None
    before = parent.get("learned") if isinstance(parent, dict) else None
    paths = [p for p in [*(own if isinstance(own, list) else []), *(before if isinstance(before, list) else [])]
             if isinstance(p, str)]
    return list(dict.fromkeys(paths))[:LEARNED_MOST]


def last_moved_to(model_dir: str | os.PathLike) -> str | None:
    """The version promotions.jsonl says CURRENT was moved to last, if it is still here (what
    the servers serve while CURRENT is missing: serving/watch.py); None otherwise."""
    moves = promotions(model_dir)
    last = moves[-1]["to"] if moves else None
    return last if isinstance(last, str) and VERSION_RE.match(last) and (Path(model_dir) / last).is_dir() else None


def _served_stack(moves: list[dict]) -> list[str]:
    """The versions served before, as the recorded moves leave them: a promotion pushes the
    version it replaced, a rollback pops."""
    stack: list[str] = []
    for rec in moves:
        if rec.get("reason") == "rollback":
            if stack:
                stack.pop()
        elif rec.get("from"):
            stack.append(rec["from"])
    return stack


def _unrecorded_move(moves: list[dict], current: str | None) -> tuple[str, str, str] | None:
    """(from, to, reason) of a move of CURRENT to `current` that left no line, or None: a
    rollback when `current` is the version a rollback from the last one recorded goes to,
    else a move from it ("unrecorded")."""
    last = moves[-1]["to"] if moves else None
    if current is None or not isinstance(last, str) or last == current:
        return None
    stack = _served_stack(moves)
    return last, current, "rollback" if stack and stack[-1] == current else "unrecorded"


def _sync_after_rename(d: Path, what: str) -> None:
    """fsync `d` after a rename into it; a failure is a warning: the rename is done (readers see
    it) and must not be undone or reported as not done, but it may not outlive a power loss."""
    try:
        fsync_dir(d)
    except OSError as e:
        log.warning("%s: %s, but the directory could not be synced to disk (%s): a power loss may undo it",
                    d, what, _why(e, d))


@contextmanager
def _locked(d: Path):
    """The model dir's lock (on the directory itself, so no file is left behind): its
    moves of CURRENT and its version names are given one at a time, across processes."""
    fd = os.open(d, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _record_move(d: Path, before: str | None, version: str, reason: str) -> None:
    """A line in promotions.jsonl. CURRENT has moved already: a full disk here is a warning
    (the move stands; a rollback from it may not find where it came from), not an error
    that would have the caller undo a version CURRENT names."""
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "from": before, "to": version,
            "reason": reason}
    try:
        with open(d / PROMOTIONS, "a") as f:  # one short write: lines do not interleave
            f.write(json.dumps(line) + "\n")
    except OSError as e:
        log.warning("%s: CURRENT moved %s -> %s, but %s could not record it: %s", d, before, version, PROMOTIONS,
                    _why(e, d))


def promotions(model_dir: str | os.PathLike) -> list[dict]:
    """The recorded moves of CURRENT, oldest first. Unreadable lines are skipped, and so are
    lines whose `to` is no version name or whose `from` is neither one nor null: a `from`
    of 5 made a rollback a TypeError, and one of escape codes went into its warning raw."""
    return [rec for rec in _json_lines(Path(model_dir) / PROMOTIONS) if _named(rec.get("to"))
            and (rec.get("from") is None or _named(rec["from"]))]


def _named(value) -> bool:
    return isinstance(value, str) and VERSION_RE.match(value) is not None


def decisions(model_dir: str | os.PathLike) -> list[dict]:
    """The retrain verdicts recorded in the model dir, oldest first."""
    return [rec for rec in _json_lines(Path(model_dir) / DECISIONS) if "verdict" in rec]


_UNREADABLE: dict[str, str] = {}  # journal -> why it could not be read, as last said


def _json_lines(path: Path) -> list[dict]:
    """The records of a journal (promotions.jsonl, decisions.jsonl); damaged lines skipped. One
    that cannot be read is read as holding none, and said once until it can be read again (the
    web UI and the serve watcher read them every second or so)."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        _UNREADABLE.pop(str(path), None)
        return []
    except OSError as e:  # a directory in its place, a file of another owner: read as none, said
        why = str(e.strerror or e)
        if _UNREADABLE.get(str(path)) != why:
            _UNREADABLE[str(path)] = why
            log.warning("%s: cannot read it (%s): read as holding no record", path, why)
        return []
    if _UNREADABLE.pop(str(path), None) is not None:
        log.info("%s: readable again", path)
    out = []
    for line in text.splitlines():
        try:
            rec = loads_json(line)
        except ValueError:  # a damaged line: skipped, as the docs say
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def overview(model_dir: str | os.PathLike, limit: int = 50) -> dict | None:
    """A model dir at a glance, newest first: versions with their metrics, the retrain
    decisions and the moves of CURRENT (at most `limit` of each; `versions_total`: how many
    versions it holds); None if it does not exist."""
    d = Path(model_dir)
    try:
        if not d.is_dir():
            return None
    except (OSError, ValueError):  # a name no directory can have (too long, a NUL): none there
        return None
    try:
        current = current_version(d)
    except ModelDirError:
        current = ""
    versions, names = [], list_versions(d)
    for v in reversed(names[-limit:]):
        try:
            m = read_manifest(d, v)
        except ModelDirError as e:
            if (d / v).is_dir():  # else pruned since it was listed: not a version any more
                versions.append({"version": v, "current": v == current, "error": str(e)})
            continue
        train, model, metrics = (m.get(k) if isinstance(m.get(k), dict) else {} for k in ("train", "model", "metrics"))
        versions.append({"version": v, "current": v == current, "created": m.get("created_at"),  # a hand-edited
                         "model": model.get("kind"), "metrics": metrics,  # "metrics": 5 crashed `mariana status`
                         "rows": rows_learned(m), "job": train.get("job")})
    moves = [{"time": p.get("time"), "version": p.get("to"), "previous": p.get("from"), "reason": p.get("reason")}
             for p in promotions(d)]
    return {"dir": str(d), "current": current, "versions": versions, "versions_total": len(names),
            "decisions": decisions(d)[::-1][:limit], "promotions": moves[::-1][:limit]}


def rollback_target(model_dir: str | os.PathLike, current: str | None = None) -> str:
    """The version served before the current one came in: the moves of CURRENT are a
    stack (a promotion pushes the version it replaced, a rollback pops), so repeated
    rollbacks walk further back. A version the record names that is no longer here (pruned,
    deleted) is passed over, with a warning; when every one is gone, ModelDirError says so
    (never a version below that was never served, such as a refused candidate). Without a
    record, the version below CURRENT. `current`: the version to roll back from (default:
    what CURRENT names now)."""
    current = current or current_version(model_dir)
    target, gone = _rollback_walk(model_dir, current)
    if target is None and gone:
        raise ModelDirError(f"{model_dir}: nothing to roll back to: {_listed(gone)}, served before {current}, "
                            f"{'is' if len(gone) == 1 else 'are'} no longer in the directory (pruned or deleted); "
                            "promote a version by name instead (see 'mariana model list')")
    if target is None:
        raise ModelDirError(f"{model_dir}: nothing to roll back to (no version was served before {current})")
    if gone:
        log.warning("%s: %s, served before %s, %s no longer in the directory (pruned or deleted): a rollback goes "
                    "to %s, served before %s", model_dir, _listed(gone), current, "is" if len(gone) == 1 else "are",
                    target, "it" if len(gone) == 1 else "them")
    return target


def _rollback_walk(model_dir: str | os.PathLike, current: str) -> tuple[str | None, list[str]]:
    """(the version a rollback from `current` goes to, None when there is none; the versions
    the record names above it on the stack that are gone from the directory)."""
    moves = promotions(model_dir)
    missing = _unrecorded_move(moves, current)  # a move to CURRENT that left no line: as if it had
    stack = _served_stack(moves + ([{"from": missing[0], "to": missing[1], "reason": missing[2]}] if missing else []))
    versions = list_versions(model_dir)
    gone: list[str] = []
    while stack:
        target = stack.pop()
        if target == current:
            continue
        if target in versions:
            return target, gone
        if target not in gone:
            gone.append(target)
    if gone:  # the record names what served before, and none of it is here: no guess below
        return None, gone
    older = [v for v in versions if int(v[1:]) < int(current[1:])]
    return (older[-1] if older else None), []


def _listed(names: list[str], most: int = 5) -> str:
    """The first `most` names, and how many more (a dir pruned for months had 60 in one message).

    >>> _listed(["v000003"]), _listed(["v000003", "v000001"]), _listed([f"v{i:06d}" for i in range(9, 0, -1)])
    ('v000003', 'v000003 and v000001', 'v000009, v000008, v000007, v000006, v000005 and 4 more')
    """
    if len(names) > most:
        return ", ".join(names[:most]) + f" and {len(names) - most} more"
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"


def prune(model_dir: str | os.PathLike, keep: int, dry_run: bool = False) -> dict:
    """Remove every version but the one CURRENT names, the one a rollback would go back to
    now (`rollback_target`: so a rollback always works) and the newest `keep` (by name), and
    what an interrupted prune left (hidden `.pruned-*` dirs); nothing else is touched. Under
    the dir's lock, CURRENT re-read under it: no move of CURRENT lands meanwhile, and a version
    published meanwhile is newer than any listed. Each version is renamed to a hidden name
    (the dir fsynced) before it is deleted: a reader finds all of it or none, and a crash
    leaves only a hidden dir, which the next prune removes. Returns what it kept and why,
    what it removed with its bytes, the bytes freed, and the errors (a version that could not
    be removed is left, and named there); with `dry_run` what it would remove.

    >>> tmp = tempfile.TemporaryDirectory()
    >>> for _ in range(4): _ = save_version(tmp.name, {}, {"w": np.zeros(1, np.float32)}, reason="trained")
    >>> r = prune(tmp.name, keep=1)
    >>> r["current"], r["rollback_target"], [x["name"] for x in r["removed"]], list_versions(tmp.name)
    ('v000004', 'v000003', ['v000001', 'v000002'], ['v000003', 'v000004'])
    >>> tmp.cleanup()
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the newest versions kept besides CURRENT and the rollback target), "
                         f"got {keep}")
    d = resolved(model_dir)
    _current_to_prune(d)  # a missing dir, no CURRENT: said before the lock is taken (it needs the dir)
    with _locked(d):
        current = _current_to_prune(d)  # again under the lock: CURRENT cannot move until it is released
        target, _ = _rollback_walk(d, current)
        kept, remove = _prune_plan(d, current, target, keep)
        removed, errors = [], []
        removed += [{**x, "leftover": True} for x in sweep_debris(d, dry_run, locked=True)]
        for name in remove:
            item = {"name": name, "bytes": _size(d / name), "leftover": bool(PRUNED_RE.match(name))}
            why = None if dry_run else _remove(d, name)
            if why:
                errors.append(why)
            else:
                removed.append(item)
        if removed and not dry_run:
            fsync_dir(d)
    return {"model_dir": str(d), "dry_run": dry_run, "keep": keep, "current": current, "rollback_target": target,
            "kept": kept, "removed": removed, "bytes_freed": sum(r["bytes"] for r in removed), "errors": errors}


def sweep_debris(d: Path, dry_run: bool = False, locked: bool = False) -> list[dict]:
    """Remove what writers killed midway left in model dir `d`: temp version dirs no writer
    holds (save_version keeps an flock on its temp dir until the version is in place; one
    that can be locked here and has not changed for UNLOCKED_S is left over, whatever host or
    PID namespace wrote it), and temp CURRENT / HIGHEST_VERSION files, which are only written
    under the dir's lock and so are left over whenever this holds it. Returns [{name, bytes}]
    removed (with `dry_run`, what it would remove); what cannot be told or removed is left.
    `locked`: the caller holds the dir's lock (prune) and it is not taken again."""
    gone = []
    try:
        with contextlib.nullcontext() if locked else _locked(d):
            entries = list(os.scandir(d))
            for e in entries:
                if _MOVE_RE.match(e.name) and e.is_file(follow_symlinks=False):
                    gone += _remove_debris(e, dry_run)
    except OSError:
        return gone
    for e in entries:
        if _TMP_RE.match(e.name) and e.is_dir(follow_symlinks=False) and _abandoned(e):
            gone += _remove_debris(e, dry_run)
    return sorted(gone, key=lambda x: x["name"])


def _abandoned(e: os.DirEntry) -> bool:
    """Whether temp version dir `e` is unlocked (its writer is gone) and unchanged for UNLOCKED_S."""
    try:
        if time.time() - e.stat(follow_symlinks=False).st_mtime < UNLOCKED_S:
            return False
        fd = os.open(e.path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # held (a writer at work), or a filesystem without locks: not known to be left over
        return False
    finally:
        os.close(fd)


def _remove_debris(e: os.DirEntry, dry_run: bool) -> list[dict]:
    try:
        size = _size(Path(e.path)) if e.is_dir(follow_symlinks=False) else e.stat(follow_symlinks=False).st_size
        if not dry_run:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)
    except OSError:
        return []
    return [{"name": e.name, "bytes": size}]


def _current_to_prune(d: Path) -> str:
    try:
        return current_version(d)
    except ModelDirError as e:  # without a version known to serve, nothing is known safe to remove
        raise ModelDirError(f"{e}; prune removed nothing") from None


def _prune_plan(d: Path, current: str, target: str | None, keep: int) -> tuple[list[dict], list[str]]:
    """([{version, why}] kept, names to remove: versions, then leftovers of a prune)."""
    versions = list_versions(d)
    links = [v for v in versions if (d / v).is_symlink()]  # not a version dir of this one: left as it is
    why: dict[str, list[str]] = {v: ["a symbolic link"] if v in links else [] for v in versions}
    why[current].append("CURRENT")
    if target is not None:
        why[target].append("rollback target")
    for v in [v for v in versions if v not in links][-keep:]:
        why[v].append(f"newest {keep}")
    leftovers = sorted(e.name for e in os.scandir(d) if PRUNED_RE.match(e.name) and e.is_dir(follow_symlinks=False))
    return ([{"version": v, "why": w} for v, w in why.items() if w],
            [v for v in versions if not why[v]] + leftovers)


def _remove(d: Path, name: str) -> str | None:
    """Delete version (or leftover) `name`, a version renamed aside first; why not, or None."""
    path = d / name
    if VERSION_RE.match(name):
        aside = d / f"{PRUNED}{name}-{os.getpid()}"
        try:
            os.rename(path, aside)
        except OSError as e:
            return f"{d}: cannot remove {name}: {_why(e, d)}; it was left as it is"
        path = aside
    try:
        fsync_dir(d)  # the rename is on disk before any of its files goes
        shutil.rmtree(path)
    except OSError as e:
        return (f"{d}: {name} was not all removed ({_why(e, d)}): what is left is {path.name}, which the next "
                "prune removes")
    return None


def _size(path: Path) -> int:
    """Bytes of the files under `path` (links not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def rows_learned(manifest: dict) -> int | None:
    """The rows a version's weights learned from in its own training: every epoch's up to the
    one kept (`--epochs auto` keeps the best; `train.rows` counts every epoch read), less a warm
    start's parent's. `train.rows` where there is no `rows_trained` (speech and image versions).

    >>> rows_learned({"rows_trained": 50, "parent": {"rows_trained": 20}, "train": {"rows": 90}})
    30
    >>> rows_learned({"train": {"rows": 90}})
    90
    """
    train = manifest.get("train") if isinstance(manifest.get("train"), dict) else {}
    kept, parent = manifest.get("rows_trained"), manifest.get("parent")
    if not isinstance(kept, int) or isinstance(kept, bool):
        return train.get("rows")
    before = parent.get("rows_trained") if isinstance(parent, dict) else 0
    return kept - before if isinstance(before, int) and 0 <= before <= kept else kept


def read_manifest(model_dir: str | os.PathLike, version: str) -> dict:
    """A version's manifest alone (no arrays): for listings."""
    vdir = Path(model_dir) / version
    try:
        manifest = loads_json((vdir / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise ModelDirError(f"{vdir}: no {MANIFEST}") from None
    except OSError as e:
        raise ModelDirError(f"{vdir}/{MANIFEST}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ModelDirError(f"{vdir}/{MANIFEST}: not UTF-8 text (byte {e.start}): a damaged file") from None
    except ValueError as e:  # JSONDecodeError, and what loads_json says
        raise ModelDirError(f"{vdir}/{MANIFEST}: not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise ModelDirError(f"{vdir}/{MANIFEST}: a JSON {type(manifest).__name__}, not an object")
    return manifest


def save_version(model_dir: str | os.PathLike, manifest: dict, weights: dict[str, np.ndarray],
                 optimizer: dict[str, np.ndarray] | None = None, make_current: bool = True,
                 reason: str | None = None) -> str:
    """Write a new version; returns its name, one never given in this dir before
    (`_new_name`). With `make_current`, CURRENT moves to it (recorded as `reason` when given)."""
    d = resolved(model_dir)
    bad = finite.nonfinite(weights)
    if bad:  # a version no server loads; CURRENT would have named it (a speech run diverged at --lr 1e8)
        raise ModelDirError(f"{model_dir}: nothing was published: the trained weights hold {finite.describe(bad)} "
                            f"(training diverged: lower the learning rate){current_note(d, 'still ')}")
    tmp = held = None
    # the name, its publish and CURRENT's move are one step under the dir's lock: when writers race,
    # CURRENT moves in the order of their names, so the newest published is CURRENT at the end
    lock = contextlib.ExitStack()
    try:
        d.mkdir(parents=True, exist_ok=True)
        sweep_debris(d)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP}{_HOST}-{os.getpid()}-", dir=d))
        held = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        with contextlib.suppress(OSError):  # a filesystem without locks: sweep_debris then never takes it
            fcntl.flock(held, fcntl.LOCK_EX)  # until the version is in place: sweep_debris leaves it alone
        save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(tmp / WEIGHTS))
        if optimizer:
            save_file({k: np.ascontiguousarray(v) for k, v in optimizer.items()}, str(tmp / OPTIMIZER))
        written = file_digests(tmp, (WEIGHTS, OPTIMIZER) if optimizer else (WEIGHTS,))  # once, whatever the name
        lock.enter_context(_locked(d))
        version = ""
        while True:  # each turn a higher name: one taken meanwhile (a file, a writer elsewhere) is passed over
            version = _new_name(d, after=version)
            body = dict(manifest, format=FORMAT, version=version)
            body[DIGESTS] = {**written, "manifest": manifest_sha256(body)}
            (tmp / MANIFEST).write_text(json.dumps(body, indent=2, sort_keys=True))
            if publish_dir(tmp, d / version):  # False: another writer took the name
                break
        _record_highest(d, version, locked=True)
    except (OSError, SafetensorError) as e:
        lock.close()
        raise ModelDirError(f"{model_dir}: cannot write a new version: {_why(e, d)}; nothing was published"
                            f"{current_note(d, 'still ')}") from None
    except BaseException:
        lock.close()
        raise
    finally:
        if held is not None:
            os.close(held)  # the lock goes with it
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    with lock:
        if make_current:
            _make_current(d, version, reason, model_dir)
    return version


def _make_current(d: Path, version: str, reason: str | None, model_dir: str | os.PathLike) -> None:
    """save_version's move of CURRENT to the version it published, under the dir's lock; a
    move that fails takes the version away again (or says it could not)."""
    try:
        _move_current(d, version, reason)
    except (OSError, ModelDirError) as e:  # CURRENT did not move (set_current says why)
        why = _why(e, d) if isinstance(e, OSError) else str(e).removeprefix(f"{d}: ")
        try:
            moved = current_version(d) == version
        except ModelDirError:
            moved = False
        if moved:  # never undo a version CURRENT names
            raise ModelDirError(f"{model_dir}: wrote {version}, and CURRENT names it, but {why}") from None
        shutil.rmtree(d / version, ignore_errors=True)  # never left behind as a newest version nobody chose
        left = (f"{version} could not be removed: it is there, not current (promote it or remove it)"
                if (d / version).exists() else f"{version} was removed")
        raise ModelDirError(f"{model_dir}: wrote {version} but {why}; {left}") from None


def _new_name(d: Path, after: str = "") -> str:
    """One more than the highest of: the names of the entries here (versions, and files or
    links in the way), HIGHEST_VERSION (the highest name ever given: a version deleted does
    not hand its name to the next, which a server still holding the deleted one would take
    for it) and `after` (a name just lost to another writer)."""
    taken = [int(m.group(1)) for m in map(VERSION_RE.match, os.listdir(d)) if m]
    return f"v{max([_highest_given(d), int(after[1:] or 0), *taken]) + 1:06d}"


def _record_highest(d: Path, version: str, locked: bool = False) -> None:
    """HIGHEST_VERSION raised to the version just published (never lowered: writers finish
    in any order, and take turns under the dir's lock). Unwritable, it is a warning: the
    version stands, and the name stays taken as long as the version is there."""
    tmp = d / f".{HIGHEST}.{os.getpid()}"
    try:
        with contextlib.nullcontext() if locked else _locked(d):
            if int(version[1:]) > _highest_given(d):
                tmp.write_text(version + "\n")
                fsync_file(tmp)
                os.replace(tmp, d / HIGHEST)
                fsync_dir(d)
    except OSError as e:
        log.warning("%s: wrote %s, but %s could not record it: %s", d, version, HIGHEST, _why(e, d))
    finally:
        tmp.unlink(missing_ok=True)


def _highest_given(d: Path) -> int:
    """The number HIGHEST_VERSION records; 0 without one (a model dir from before it)."""
    try:
        text = (d / HIGHEST).read_text(errors="replace").strip()
    except FileNotFoundError:
        return 0
    m = VERSION_RE.match(text)
    if not m:
        log.warning("%s/%s holds %r, not a version name: new names follow the versions here", d, HIGHEST, text[:40])
        return 0
    return int(m.group(1))


def _why(e: BaseException, d: Path) -> str:
    """What went wrong writing into `d` (sparse.files.why's words for an OSError), with the
    free space, or the inodes, when the disk is full (safetensors' errors say so in text)."""
    text = why(e) if isinstance(e, OSError) else str(e)
    if text == DISK_FULL or "No space left" in str(e):
        try:
            st = os.statvfs(d)
            text = (f"no space left on its filesystem ({st.f_bavail * st.f_frsize:,} bytes free)" if st.f_favail
                    or not st.f_files else f"no inodes left on its filesystem (it holds as many files as it "
                    f"can, {st.f_files:,}; {st.f_bavail * st.f_frsize:,} bytes free)")
        except OSError:
            text = DISK_FULL
    return text


def current_note(d: str | os.PathLike, still: str = "") -> str:
    """The end of an error that leaves the model dir: "; CURRENT {still}names vN", or that none does."""
    try:
        return f"; CURRENT {still}names {current_version(d)}"
    except ModelDirError:
        return "; there is no CURRENT version"


def load_version(model_dir: str | os.PathLike, version: str | None = None,
                 with_optimizer: bool = False) -> tuple[dict, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(manifest, weights, optimizer state or {}) of `version` (default: CURRENT)."""
    version = version or current_version(model_dir)
    vdir = Path(model_dir) / version
    manifest = read_manifest(model_dir, version)
    if manifest.get("format") != FORMAT:
        raise ModelDirError(f"{vdir}: unknown model format {manifest.get('format')!r} (expected {FORMAT})")
    check_digests(vdir, manifest, (WEIGHTS, OPTIMIZER) if with_optimizer else (WEIGHTS,))
    weights = read_weights(vdir)
    if with_optimizer:
        check_optimizer_state(vdir)
    try:
        opt = load_file(str(vdir / OPTIMIZER)) if with_optimizer else {}
    except (OSError, SafetensorError) as e:
        raise ModelDirError(f"{vdir}: cannot read tensors: {e}") from None
    _check_optimizer_values(vdir, opt)
    return manifest, weights, opt


def _check_optimizer_values(vdir: Path, opt: dict[str, np.ndarray]) -> None:
    """ModelDirError for optimizer state no optimizer writes: a NaN or an infinity, or a sum of
    squares below 0 (FTRL's n, AdaGrad's sum_sq). Going on from it diverged, and the error
    blamed the learning rates; one bad row was copied into the next version in silence."""
    bad = finite.nonfinite(opt)
    if bad:
        raise ModelDirError(f"{vdir}: {OPTIMIZER} holds {finite.describe(bad)}: a corrupt version, not warm-started "
                            "from; name another version, or train from scratch")
    negative = [k for k, v in opt.items() if k.rsplit(".", 1)[-1] in ("n", "sum_sq") and v.size and v.min() < 0]
    if negative:
        raise ModelDirError(f"{vdir}: {OPTIMIZER} holds a sum of squares below 0 in {', '.join(sorted(negative))}: "
                            "a corrupt version, not warm-started from; name another version, or train from scratch")


def check_optimizer_state(vdir: str | os.PathLike) -> None:
    """ModelDirError when a version lacks its optimizer state, which going on from it needs:
    without FTRL's z and n its first step overwrote the parent's weights with a fresh
    state's, and the warm start learnt no more than a cold one (AUC 0.685 against 0.749)."""
    if not (Path(vdir) / OPTIMIZER).is_file():
        raise ModelDirError(f"{vdir}: no {OPTIMIZER} (the optimizer's state): a warm start goes on from the weights "
                            "and that state; name another version, or train from scratch")


def read_weights(vdir: Path) -> dict[str, np.ndarray]:
    """A version's weights, refused (ModelDirError) when they cannot be read or hold a NaN
    or an infinity: such a version would answer NaN."""
    try:
        with open(vdir / WEIGHTS, "rb"):  # safetensors says "No such file" for a file it may not read
            pass
        weights = load_file(str(vdir / WEIGHTS))
    except PermissionError as e:
        raise ModelDirError(f"{vdir}/{WEIGHTS}: cannot read it: {e.strerror}") from None
    except (OSError, SafetensorError) as e:
        raise ModelDirError(f"{vdir}: cannot read tensors: {e}") from None
    bad = finite.nonfinite(weights)
    if bad:
        raise ModelDirError(f"{vdir}: {WEIGHTS} holds {finite.describe(bad)}: a corrupt or diverged version, "
                            "not loaded")
    return weights


def publish_dir(tmp: Path, final: Path, replace: bool = False) -> bool:
    """Put the finished temp dir `tmp` in place as `final`, all of it or nothing: its files
    fsynced, its modes the umask's, one rename, the parent dir fsynced. False (and `tmp`
    left as it is) when `final` exists: another writer put its own there first.

    `replace`: an existing `final` is renamed aside just before (and removed after), so a
    reader finds the old dir or the new one, never part of one; only between the two
    renames, a moment, neither."""
    for f in tmp.iterdir():
        fsync_file(f)
    _publishable(tmp)
    aside = final.with_name(f".old-{final.name}-{os.getpid()}")
    try:
        if replace and final.exists():
            os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            return False
        _sync_after_rename(final.parent, f"{final.name} was put in place")
        return True
    finally:
        if aside.exists():
            shutil.rmtree(aside, ignore_errors=True)


def _publishable(vdir: Path) -> None:
    """mkdtemp makes 0700 dirs: give the version the modes of the process umask
    (default 755/644), so a server running as another user can read it."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(vdir, 0o777 & ~umask)
    for f in vdir.iterdir():
        os.chmod(f, 0o666 & ~umask)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
