import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from mariana.sparse.errors import ModelDirError
from mariana.trainer import checkpoint
from mariana.trainer.bundle import ModelBundle
from tests.conftest import reseal
from mariana.trainer.config import load_config
from mariana.trainer.data import BatchStream
from mariana.trainer.strategies.local import train_local


def trained(kind, train_file, **over):
    cfg = load_config(env={}, overrides={"model.kind": kind, "hashing.bits": 16, "train.batch_size": 512,
                                         "model.embed_dim": 4, "model.hidden": [8], **over})
    bundle = ModelBundle(cfg, cfg.data.resolve_schema())
    train_local(bundle, [str(train_file)])
    return bundle


def predictions(bundle, path):
    return np.concatenate([bundle.predict(b) for b in BatchStream([str(path)], bundle.encoder)])


@pytest.mark.parametrize("kind,linear", [("lr", "adagrad"), ("lr", "ftrl"), ("dnn", "adagrad")])
def test_round_trip_gives_equal_predictions(tmp_path, gen_files, kind, linear):
    bundle = trained(kind, gen_files["train"], **{"optim.linear": linear})
    version = bundle.save(str(tmp_path / "m"))
    loaded = ModelBundle.load(str(tmp_path / "m"), with_optimizer=True)
    assert version == "v000001" and loaded.manifest["version"] == version
    np.testing.assert_array_equal(predictions(bundle, gen_files["test"]), predictions(loaded, gen_files["test"]))
    for name, table in bundle.tables.items():
        rows = table.touched_rows()
        np.testing.assert_array_equal(loaded.tables[name].touched_rows(), rows)
        for key, state in table.state.items():
            np.testing.assert_array_equal(loaded.tables[name].state[key][rows], state[rows])
    assert loaded.rows_trained == bundle.rows_trained == 30_000


def test_versions_and_current(tmp_path, gen_files):
    bundle = trained("lr", gen_files["train"])
    d = str(tmp_path / "m")
    assert [bundle.save(d) for _ in range(3)] == ["v000001", "v000002", "v000003"]
    assert checkpoint.current_version(d) == "v000003"
    assert checkpoint.list_versions(d) == ["v000001", "v000002", "v000003"]
    bundle.save(d, make_current=False)
    assert checkpoint.current_version(d) == "v000003"
    checkpoint.set_current(d, "v000001")
    assert ModelBundle.load(d).manifest["version"] == "v000001"
    assert not [p for p in (tmp_path / "m").iterdir() if p.name.startswith(".")]  # no temp leftovers
    # a move that expects another CURRENT changes nothing and says what it found
    checkpoint.set_current(d, "v000002", reason="promoted", expect="v000001")
    moves = (tmp_path / "m" / checkpoint.PROMOTIONS).read_text()
    with pytest.raises(checkpoint.CurrentMoved, match="CURRENT names v000002, not v000001"):
        checkpoint.set_current(d, "v000003", reason="retrain", expect="v000001")
    assert checkpoint.current_version(d) == "v000002" and (tmp_path / "m" / checkpoint.PROMOTIONS).read_text() == moves
    with pytest.raises(checkpoint.CurrentMoved, match="CURRENT names v000002, not no version"):
        checkpoint.set_current(d, "v000003", expect=None)
    # a path to a version (here or in another dir) is no version name: CURRENT would name nothing here
    (tmp_path / "other" / "v000001").mkdir(parents=True)
    for name in ("../other/v000001", str(tmp_path / "m" / "v000001"), "v000001/../v000003", ".", ""):
        with pytest.raises(ModelDirError, match="is not a version name"):
            checkpoint.set_current(d, name, reason="promoted")
    assert checkpoint.current_version(d) == "v000002" and (tmp_path / "m" / checkpoint.PROMOTIONS).read_text() == moves


def test_a_version_with_nan_or_infinite_weights_is_not_loaded(tmp_path, gen_files):
    """A corrupt or diverged version would answer NaN for every request: refused at load,
    naming the arrays, for a server's watcher to keep the version it serves."""
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "m"
    trained("dnn", gen_files["train"]).save(str(d))
    weights = d / "v000001" / checkpoint.WEIGHTS
    good = load_file(str(weights))
    for poison in (np.nan, np.inf, -np.inf):
        arrays = dict(good)
        name = sorted(k for k, a in arrays.items() if a.dtype.kind == "f")[-1]
        arrays[name] = arrays[name].copy()
        arrays[name].flat[len(arrays[name].flat) // 2] = poison
        save_file(arrays, str(weights))
        reseal(weights.parent)  # as a writer that sealed them would leave it: past the digests, to the values
        with pytest.raises(ModelDirError, match=f"NaN or infinite values \\(in {name}\\).*not loaded"):
            ModelBundle.load(str(d))
    save_file(good, str(weights))
    reseal(weights.parent)
    assert ModelBundle.load(str(d)).manifest["version"] == "v000001"


def test_no_pickle_in_a_version(tmp_path, gen_files):
    bundle = trained("lr", gen_files["train"])
    vdir = tmp_path / "m" / bundle.save(str(tmp_path / "m"))
    assert sorted(p.name for p in vdir.iterdir()) == ["manifest.json", "optimizer.safetensors",
                                                      "weights.safetensors"]
    manifest = json.loads((vdir / "manifest.json").read_text())
    assert manifest["config"]["hashing"]["bits"] == 16 and manifest["schema"]["name"] == "criteo"
    for f in vdir.iterdir():
        assert b"\x80\x04\x95" not in f.read_bytes()[:64]  # no pickle protocol header


def test_bad_model_dirs_raise_clear_errors(tmp_path):
    with pytest.raises(ModelDirError, match="no such model directory"):
        ModelBundle.load(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelDirError, match="holds no model"):
        ModelBundle.load(str(tmp_path / "empty"))
    bad = tmp_path / "bad"
    (bad / "v000001").mkdir(parents=True)
    with pytest.raises(ModelDirError, match="no CURRENT file, so no version serves; it holds v000001: pick one with "
                                            "'mariana model promote VERSION"):
        ModelBundle.load(str(bad))  # a retrain's candidate, never promoted, or a CURRENT deleted by hand
    (bad / "CURRENT").write_text("v000001\n")
    (bad / "v000001" / "manifest.json").write_text("{not json")
    with pytest.raises(ModelDirError, match="not valid JSON"):
        ModelBundle.load(str(bad))
    (bad / "v000001" / "manifest.json").write_text(json.dumps({"format": "mariana-model/1"}))
    (bad / "v000001" / "weights.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelDirError, match="cannot read tensors"):
        ModelBundle.load(str(bad))


def test_a_version_that_is_not_there_is_named_with_those_that_are(tmp_path):
    """One wording wherever a command names a version (evaluate/predict DIR:vN, a warm start,
    promote, the Python API): the versions there, the middle elided when there are many."""
    d = tmp_path / "m"
    for n in range(1, 10):
        (d / f"v{n:06d}").mkdir(parents=True)
    (d / "v000010").write_text("a file, not a version")
    checkpoint.require_version(d, "v000009")
    with pytest.raises(ModelDirError, match=r"no version 'v000010' to warm-start from \(versions: v000001, v000002, "
                                            r"\.\.\. v000007, v000008, v000009; 9 in all; 'mariana model list' "
                                            r"shows them\)"):
        checkpoint.require_version(d, "v000010", "to warm-start from")
    for name in ("../m/v000001", str(d / "v000001"), ".", ""):  # a path is no version name of this dir
        with pytest.raises(ModelDirError, match=f"no version {name!r}"):
            checkpoint.require_version(d, name)
    with pytest.raises(ModelDirError, match=r"no version 'v000001' \(versions: none;"):
        checkpoint.require_version(tmp_path, "v000001")
    with pytest.raises(ModelDirError, match="not a directory"):
        checkpoint.require_version(d / "v000010", "v000001")


def test_versions_are_readable_by_other_users(tmp_path, gen_files):
    import os
    import stat

    bundle = trained("lr", gen_files["train"])
    old = os.umask(0o022)
    try:
        vdir = tmp_path / "m" / bundle.save(str(tmp_path / "m"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(vdir.stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in vdir.iterdir()} == {0o644}


def test_a_version_written_before_a_restart_is_found_by_its_job_and_promoted_once(tmp_path, gen_files):
    """A coordinator killed between writing a version and journaling it finds the version at
    restart by the job id in its manifest (`written_version`) and ends the job with the same
    record (`written_record`); killed before CURRENT moved, CURRENT moves then, once."""
    import time

    from mariana.trainer.job import TrainSummary, publish_version, written_record, written_version

    bundle, d = trained("lr", gen_files["train"]), str(tmp_path / "m")
    tested = ({"auc": 0.7, "logloss": 0.5, "calibration": 1.0, "ne": 0.9, "count": 10, "ece": 0.01,
               "reliability": [{"rows": 10, "ctr": 0.1234567}]}, {"rows_bad": 2, "first_bad": []})

    def summary(job):
        return TrainSummary(["a.tsv"], [30_000], [1.5], 2.0, 20_000.0, 0.45, 1, None, run={"job": job})

    started = time.time() - 60
    publish_version(bundle, d, summary("j0"), ["t.tsv"], tested)
    first = publish_version(bundle, d, summary("j1"), ["t.tsv"], tested, promote=False)  # killed before CURRENT
    assert written_version(d, "j2", started) is None
    assert written_version(d, "j0", started)[0] == "v000001"
    assert written_version(d, "j0", time.time() + 3600) is None  # looks back only to the job's start
    version, manifest = written_version(d, "j1", started)
    assert version == "v000002" and checkpoint.current_version(d) == "v000001"
    again = written_record(d, version, manifest, summary("j1"), promote=True)
    drop = ("promoted", "peak_rss_mb")
    assert {k: v for k, v in again.items() if k not in drop} == {k: v for k, v in first.items() if k not in drop}
    assert checkpoint.current_version(d) == "v000002" and again["promoted"] is True
    written_record(d, version, manifest, summary("j1"), promote=True)  # a second restart moves nothing
    assert [p["to"] for p in checkpoint.promotions(d)] == ["v000001", "v000002"]


def test_a_move_of_current_it_cannot_record_stands_with_a_warning(tmp_path, caplog):
    """promotions.jsonl unwritable after CURRENT moved: the version was removed while CURRENT
    named it, and the error said "there is no CURRENT version"."""
    d = tmp_path / "m"
    d.mkdir()
    (d / checkpoint.PROMOTIONS).mkdir()  # an append to it fails, as on a full disk
    weights = {"w": np.zeros(2, np.float32)}
    version = checkpoint.save_version(d, {"model": {}}, weights, reason="trained")
    assert version == "v000001" and checkpoint.current_version(d) == "v000001" and (d / version).is_dir()
    assert "could not record it" in caplog.text


WEIGHTS = {"w": np.zeros(2, np.float32)}


def test_a_deleted_version_does_not_hand_its_name_to_the_next(tmp_path):
    """Named "highest + 1", a version written after the highest was deleted took its name,
    and a server still holding the deleted one served it under that name as the new one."""
    d = tmp_path / "m"
    for _ in range(2):
        checkpoint.save_version(d, {"model": {}}, WEIGHTS)
    checkpoint.set_current(d, "v000001")
    shutil.rmtree(d / "v000002")
    assert checkpoint.save_version(d, {"model": {}}, WEIGHTS) == "v000003"
    for v in ("v000003", "v000001"):  # every version gone, CURRENT too: still no name given twice
        shutil.rmtree(d / v)
    (d / "CURRENT").unlink()
    assert checkpoint.save_version(d, {"model": {}}, WEIGHTS) == "v000004"
    assert (d / checkpoint.HIGHEST).read_text() == "v000004\n"


@pytest.mark.timeout(20)
def _publish_versions(model_dir: str, count: int) -> list[str]:
    return [checkpoint.save_version(model_dir, {}, {"w": np.zeros(1, np.float32)}, reason="trained")
            for _ in range(count)]


def test_writers_that_race_move_current_in_the_order_of_their_versions(tmp_path):
    """Trains publishing into one dir at once (an exploratory run: 8 at a time, 3 of 21 runs
    moved CURRENT back to an older version, and 1 ended with CURRENT not the newest): a
    version's name and CURRENT's move to it are one step, so every promotion goes forward."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(6, mp_context=get_context("forkserver")) as pool:  # (its processes started once)
        for run in range(3):
            d = tmp_path / f"m{run}"
            names = sorted(n for part in pool.map(_publish_versions, [str(d)] * 6, [4] * 6) for n in part)
            moves = [m["to"] for m in checkpoint.promotions(d)]
            assert moves == names, moves  # forward only, each version once
            assert checkpoint.current_version(d) == names[-1] == (d / "HIGHEST_VERSION").read_text().strip()


def test_a_file_or_link_named_like_the_next_version_is_passed_over(tmp_path):
    """A plain file named v000002 beside v000001 made `train` spin forever: the name came
    from the directories alone, and the rename onto the file failed, the same name each turn."""
    d = tmp_path / "m"
    checkpoint.save_version(d, {"model": {}}, WEIGHTS)
    (d / "v000002").touch()
    (d / "v000003").symlink_to(tmp_path / "nowhere")
    assert checkpoint.save_version(d, {"model": {}}, WEIGHTS) == "v000004"
    assert checkpoint.current_version(d) == "v000004" and checkpoint.list_versions(d) == ["v000001", "v000004"]
    assert (d / "v000002").is_file() and (d / "v000003").is_symlink()  # what was in the way is left as it was


def test_a_model_dir_from_before_the_record_goes_on_from_its_versions(tmp_path):
    """Without HIGHEST_VERSION (written by older code, or lost) the versions there give the
    next name; from then on the record keeps a deleted name from being given again, and a
    writer finishing late never lowers it."""
    d = tmp_path / "m"
    for v in ("v000001", "v000005"):
        (d / v).mkdir(parents=True)
    assert checkpoint.save_version(d, {"model": {}}, WEIGHTS) == "v000006"
    shutil.rmtree(d / "v000006")
    checkpoint._record_highest(d, "v000002")  # a writer of a lower name, done after
    assert checkpoint.save_version(d, {"model": {}}, WEIGHTS) == "v000007"
    (d / checkpoint.HIGHEST).write_text("garbage\n")  # unreadable: the versions there still count
    assert checkpoint.save_version(d, {"model": {}}, WEIGHTS) == "v000008"


# ---- pruning --------------------------------------------------------------------------

def moved(d, *steps) -> None:
    """`steps`: (version, reason) moves of CURRENT, each written first if it is not there."""
    for version, reason in steps:
        while version not in checkpoint.list_versions(d):
            checkpoint.save_version(d, {"model": {}}, WEIGHTS, make_current=False)
        checkpoint.set_current(d, version, reason=reason)


def test_a_rollback_passes_over_a_removed_version_and_never_lands_on_one_never_served(tmp_path, caplog):
    """The stack's target gone (pruned, deleted): the one served before it, with a warning;
    all of them gone: one clear error. Before, the fallback took the version below CURRENT by
    name, here v000003, a candidate never served."""
    d = tmp_path / "m"
    moved(d, ("v000001", "trained"), ("v000002", "promoted"))
    checkpoint.save_version(d, {"model": {}}, WEIGHTS, make_current=False)  # v000003: a refused candidate
    moved(d, ("v000004", "retrain"))
    shutil.rmtree(d / "v000002")
    assert checkpoint.rollback_target(d) == "v000001"
    assert "v000002, served before v000004, is no longer in the directory" in caplog.text
    shutil.rmtree(d / "v000001")
    with pytest.raises(ModelDirError, match="nothing to roll back to: v000002 and v000001, served before v000004, "
                                            "are no longer in the directory"):
        checkpoint.rollback_target(d)


@pytest.mark.parametrize("damaged", ['{"from": 5, "to": "v000003", "reason": "promoted"}',
                                     '{"from": ["v000001"], "to": "v000003", "reason": "promoted"}',
                                     '{"from": "\\u001b[31mv9\\n", "to": "v000003", "reason": "promoted"}',
                                     '{"from": "v000002", "to": {"v": 1}, "reason": "promoted"}'],
                         ids=["int", "list", "escapes", "to-object"])
def test_a_damaged_line_of_the_record_is_skipped(tmp_path, caplog, damaged):
    """A `from` of 5 made a rollback a TypeError; one of escape codes went into its warning raw."""
    d = tmp_path / "m"
    moved(d, ("v000001", "trained"), ("v000002", "promoted"), ("v000003", "promoted"))
    with open(d / checkpoint.PROMOTIONS, "a") as f:
        f.write(damaged + "\n")
    assert checkpoint.rollback_target(d) == "v000002" and caplog.text == ""
    assert [p["to"] for p in checkpoint.promotions(d)] == ["v000001", "v000002", "v000003"]


@pytest.mark.parametrize("current", ["/srv/models/ctr/v000002\n", None], ids=["a-path", "removed"])
def test_a_move_from_a_garbled_current_records_the_version_served(tmp_path, current):
    """CURRENT holding a path (or gone): servers serve the version it was last moved to, but
    the move recorded `from: null`, and a rollback went to v000001, not to that v000002."""
    d = tmp_path / "m"
    moved(d, ("v000001", "trained"), ("v000002", "promoted"))
    checkpoint.save_version(d, {"model": {}}, WEIGHTS, make_current=False)
    if current is None:
        (d / "CURRENT").unlink()
    else:
        (d / "CURRENT").write_text(current)
    checkpoint.set_current(d, "v000003", reason="promoted")
    assert checkpoint.promotions(d)[-1]["from"] == "v000002" and checkpoint.rollback_target(d) == "v000002"
    checkpoint.set_current(d, "v000002", reason="rollback")
    assert checkpoint.rollback_target(d) == "v000001"


def test_a_move_to_a_version_removed_while_it_waited_for_the_lock_is_refused(tmp_path):
    """set_current checked the version before taking the dir's lock: a prune holding the lock
    could remove it meanwhile, and CURRENT then named no version."""
    import threading

    d = tmp_path / "m"
    moved(d, ("v000001", "trained"))
    checkpoint.save_version(d, {"model": {}}, WEIGHTS, make_current=False)
    errors = []

    def promote():
        try:
            checkpoint.set_current(d, "v000002", reason="promoted")
        except ModelDirError as e:
            errors.append(str(e))

    with checkpoint._locked(d):  # as a prune holds it
        t = threading.Thread(target=promote)
        t.start()
        t.join(0.3)
        assert t.is_alive()  # waiting for the lock
        shutil.rmtree(d / "v000002")
    t.join(10)
    assert errors and "no version 'v000002' (removed meanwhile)" in errors[0]
    assert checkpoint.current_version(d) == "v000001"


def test_prune_reads_current_again_under_the_lock(tmp_path):
    """A move of CURRENT that lands while prune waits for the lock: the version moved to stays."""
    import threading

    d = tmp_path / "m"
    moved(d, ("v000001", "trained"), ("v000002", "trained"), ("v000003", "trained"), ("v000004", "trained"))
    result = {}
    with checkpoint._locked(d):  # a promotion holding it: prune waits
        t = threading.Thread(target=lambda: result.update(checkpoint.prune(d, keep=1)))
        t.start()
        t.join(0.3)
        assert t.is_alive()
        (d / "CURRENT").write_text("v000001\n")  # what that promotion wrote
        checkpoint._record_move(d, "v000004", "v000001", "promoted")
    t.join(10)
    assert result["current"] == "v000001" and result["rollback_target"] == "v000004"
    assert checkpoint.list_versions(d) == ["v000001", "v000004"]


def test_prune_renames_a_version_aside_before_deleting_it(tmp_path, monkeypatch):
    """A delete that stops half way (a crash, an I/O error) leaves a hidden dir, never part of
    a version under its name; the next prune removes it."""
    d = tmp_path / "m"
    moved(d, ("v000001", "trained"), ("v000002", "trained"), ("v000003", "trained"))

    def broken(path, *a, **k):
        (Path(path) / checkpoint.WEIGHTS).unlink()  # half gone
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(checkpoint.shutil, "rmtree", broken)
    result = checkpoint.prune(d, keep=1)
    assert result["removed"] == [] and "v000001 was not all removed (Input/output error)" in result["errors"][0]
    assert checkpoint.list_versions(d) == ["v000002", "v000003"]
    hidden = [p.name for p in d.iterdir() if p.name.startswith(".pruned-")]
    assert hidden == [f".pruned-v000001-{os.getpid()}"]
    monkeypatch.undo()
    again = checkpoint.prune(d, keep=1)
    assert [(r["name"], r["leftover"]) for r in again["removed"]] == [(hidden[0], True)] and not again["errors"]
    assert not (d / hidden[0]).exists()


def test_prune_needs_a_current_version(tmp_path):
    d = tmp_path / "m"
    checkpoint.save_version(d, {"model": {}}, WEIGHTS, make_current=False)
    with pytest.raises(ModelDirError, match="no CURRENT file.*prune removed nothing"):
        checkpoint.prune(d, keep=1)
    (d / "CURRENT").write_text("v000009\n")
    with pytest.raises(ModelDirError, match="CURRENT names 'v000009'.*prune removed nothing"):
        checkpoint.prune(d, keep=1)
    assert checkpoint.list_versions(d) == ["v000001"]


def test_a_disk_error_after_current_moved_never_undoes_the_move(tmp_path, monkeypatch, caplog):
    """EIO from the directory's fsync after CURRENT was renamed: save_version removed the
    version CURRENT then named (nothing servable was left), and a promotion said only
    "input/output error" though CURRENT had moved, with no line in promotions.jsonl."""
    import errno

    d = tmp_path / "m"
    moved(d, ("v000001", "trained"))

    def eio(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(checkpoint, "fsync_dir", eio)
    assert checkpoint.save_version(d, {"model": {}}, WEIGHTS, reason="trained") == "v000002"
    assert checkpoint.current_version(d) == "v000002" and checkpoint.list_versions(d) == ["v000001", "v000002"]
    assert "CURRENT moved v000001 -> v000002, but the directory could not be synced" in caplog.text
    assert checkpoint.set_current(d, "v000001", reason="promoted") == "v000002"
    assert [(m["from"], m["to"]) for m in checkpoint.promotions(d)][-2:] == [("v000001", "v000002"),
                                                                             ("v000002", "v000001")]


def test_a_version_that_cannot_be_removed_is_not_said_removed(tmp_path, monkeypatch):
    """CURRENT could not move and the new version could not be removed either (a filesystem
    gone read-only): the error said "v000002 was removed" while it stayed, listed."""
    d = tmp_path / "m"
    moved(d, ("v000001", "trained"))
    monkeypatch.setattr(checkpoint.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(30, "Read-only")))
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda *a, **k: None)
    with pytest.raises(ModelDirError, match="wrote v000002 but cannot move CURRENT to v000002: its filesystem is "
                                            "read-only; CURRENT still names v000001; v000002 could not be removed: "
                                            r"it is there, not current \(promote it or remove it\)"):
        checkpoint.save_version(d, {"model": {}}, WEIGHTS, reason="trained")


def test_a_move_of_current_left_unrecorded_is_reconciled(tmp_path):
    """Killed between CURRENT's rename and its promotions.jsonl line (2 of 30 kills in an
    exploratory run), a rollback went to the version before the last one recorded, and prune
    removed the one really served before."""
    d = tmp_path / "m"
    moved(d, ("v000001", "trained"), ("v000002", "trained"))
    checkpoint.save_version(d, {"model": {}}, WEIGHTS, make_current=False)
    (d / "CURRENT").write_text("v000003\n")  # the move whose line was never written
    assert checkpoint.rollback_target(d) == "v000002"
    kept = checkpoint.prune(d, keep=1, dry_run=True)["kept"]
    assert {k["version"]: k["why"] for k in kept}["v000002"] == ["rollback target"]
    moved(d, ("v000004", "trained"))  # the next move writes the missing line first
    assert [(m["from"], m["to"], m["reason"]) for m in checkpoint.promotions(d)][-2:] == [
        ("v000002", "v000003", "unrecorded"), ("v000003", "v000004", "trained")]
    assert checkpoint.rollback_target(d) == "v000003"
    checkpoint.set_current(d, "v000003", reason="rollback")
    assert checkpoint.rollback_target(d) == "v000002"


def test_a_rollback_left_unrecorded_is_taken_for_one(tmp_path):
    """v1 -> v2 -> v3, then CURRENT back to v2 with no line (a rollback whose line a full disk
    refused, or done by hand): taken for a promotion, the next rollback went to v3, the
    version just abandoned; it goes to v1, and the next move records the rollback."""
    d = tmp_path / "m"
    moved(d, ("v000001", "trained"), ("v000002", "trained"), ("v000003", "trained"))
    (d / "CURRENT").write_text("v000002\n")
    assert checkpoint.rollback_target(d) == "v000001"
    moved(d, ("v000004", "trained"))
    assert [(m["from"], m["to"], m["reason"]) for m in checkpoint.promotions(d)][-2:] == [
        ("v000003", "v000002", "rollback"), ("v000002", "v000004", "trained")]
    assert checkpoint.rollback_target(d) == "v000002"


def test_what_killed_writers_leave_is_swept_and_a_live_writers_is_not(tmp_path):
    """A SIGKILL during a save left its .tmp-* version dir (and .CURRENT.<pid> files) for ever:
    7 dirs, 16 MB, after 10 kills; prune and list never saw them. The next save, and prune,
    now remove a temp dir no writer holds locked (whatever host or PID namespace wrote it),
    and the temp files of a move of CURRENT (written under the dir's lock only)."""
    import fcntl

    d = tmp_path / "m"
    moved(d, ("v000001", "trained"))

    def temp_dir(name: str, age: float) -> Path:
        (d / name).mkdir()
        (d / name / checkpoint.WEIGHTS).write_bytes(b"x" * 1000)
        os.utime(d / name, (time.time() - age, time.time() - age))
        return d / name

    dead = [temp_dir(".tmp-host_a-123-abcd1234", 120).name, temp_dir(".tmp-aged1234", 120).name]
    for name in (".CURRENT.99999999", ".HIGHEST_VERSION.99999999"):
        (d / name).write_text("v000009\n")
        dead.append(name)
    live = temp_dir(".tmp-host_b-456-live0001", 120)  # a writer at work, on any host: it holds the lock
    young = temp_dir(".tmp-young123", 0)  # unlocked for less than a minute: just made, not locked yet
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        r = checkpoint.prune(d, keep=1, dry_run=True)
        assert sorted(x["name"] for x in r["removed"] if x["leftover"]) == sorted(dead)
        assert all((d / n).exists() for n in dead)  # a dry run
        assert next(x for x in r["removed"] if x["name"] == dead[0])["bytes"] == 1000
        checkpoint.save_version(d, {"model": {}}, WEIGHTS, reason="trained")
        assert sorted(p.name for p in d.iterdir() if p.name.startswith(".")) == sorted([live.name, young.name])
    finally:
        os.close(fd)


def test_damaged_bytes_in_a_model_dir_are_errors_not_tracebacks(tmp_path, caplog):
    """A CURRENT of NUL bytes (what a power loss leaves) or not UTF-8, a manifest with one bit
    flipped, a promotions.jsonl line not UTF-8: UnicodeDecodeError and "embedded null byte"
    tracebacks from predict, evaluate, model list, rollback, prune and serve."""
    d = tmp_path / "m"
    moved(d, ("v000001", "trained"), ("v000002", "trained"))
    for junk, says in ((b"\0" * 8, "CURRENT names .*, which is not a version here"),
                       (b"\xff\n", r"CURRENT is not text \(b'\\xff\\n'\), so it names no version here")):
        (d / "CURRENT").write_bytes(junk)
        with pytest.raises(ModelDirError, match=says):
            checkpoint.current_version(d)
    (d / "CURRENT").write_text("v000002\n")
    manifest = d / "v000001" / checkpoint.MANIFEST
    body = bytearray(manifest.read_bytes())
    body[5] |= 0x80
    manifest.write_bytes(bytes(body))
    with pytest.raises(ModelDirError, match=r"v000001/manifest.json: not UTF-8 text \(byte 5\): a damaged file"):
        checkpoint.read_manifest(d, "v000001")
    with open(d / checkpoint.PROMOTIONS, "ab") as f:
        f.write(b'{"from": "v000002", "to": "\xff"}\n')
    assert checkpoint.rollback_target(d) == "v000001"  # the damaged line skipped, as the docstring says


def test_optimizer_state_no_optimizer_writes_is_refused_for_a_warm_start(tmp_path):
    """FTRL's n at -1 or NaN: the warm start diverged and the error blamed the learning rates;
    with one bad row it went on in silence and copied the row into the next version."""
    from safetensors.numpy import save_file

    d = tmp_path / "m"
    checkpoint.save_version(d, {"model": {}}, WEIGHTS, {"table.linear.n": np.ones((4, 1), np.float32),
                                                        "table.linear.z": np.zeros((4, 1), np.float32)})
    opt = d / "v000001" / checkpoint.OPTIMIZER
    checkpoint.load_version(d, "v000001", with_optimizer=True)
    for n, says in ((-1.0, r"a sum of squares below 0 in table.linear.n"), (np.nan, "NaN or infinite values")):
        bad = np.ones((4, 1), np.float32)
        bad[2] = n
        save_file({"table.linear.n": bad, "table.linear.z": np.zeros((4, 1), np.float32)}, str(opt))
        reseal(opt.parent)
        with pytest.raises(ModelDirError, match=f"optimizer.safetensors holds {says}"):
            checkpoint.load_version(d, "v000001", with_optimizer=True)


def test_a_featurizer_named_as_a_model_directory_is_said_to_be_one(tmp_path):
    """`mariana predict --model FEATURIZER_DIR` said "holds no model (no CURRENT file); train
    one with 'mariana train'"."""
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / checkpoint.MANIFEST).write_text('{"format": "mariana-featurizer/1"}')
    with pytest.raises(ModelDirError, match="f: an image featurizer, not a model directory: 'mariana featurize "
                                            "--model .*/f' runs it"):
        checkpoint.current_version(tmp_path / "f")


def test_an_unreadable_journal_is_said_once_until_it_reads_again(tmp_path, caplog):
    """The web UI and every serve worker's watcher read the journals each second or so: a
    decisions.jsonl that could not be read (a directory in its place, another owner's file)
    was a warning each time."""
    caplog.set_level("INFO", logger="mariana.trainer.checkpoint")
    journal = tmp_path / "decisions.jsonl"
    journal.mkdir()
    for _ in range(3):
        assert checkpoint.decisions(tmp_path) == []
    journal.rmdir()
    journal.write_text('{"verdict": "promoted"}\n')
    assert checkpoint.decisions(tmp_path) == [{"verdict": "promoted"}]
    journal.unlink()
    journal.mkdir()
    checkpoint.decisions(tmp_path)
    said = [r.getMessage() for r in caplog.records]
    assert [m.split(": ", 1)[1] for m in said] == ["cannot read it (Is a directory): read as holding no record",
                                                   "readable again",
                                                   "cannot read it (Is a directory): read as holding no record"], said


def test_an_overview_of_a_hand_edited_manifest_has_the_shapes_it_promises(tmp_path):
    """"metrics": 5 in a manifest went through /v1/models as it was, and `mariana status` crashed on it."""
    d = tmp_path / "m"
    checkpoint.save_version(d, {"model": {"kind": "lr"}}, WEIGHTS)
    path = d / "v000001" / checkpoint.MANIFEST
    path.write_text(json.dumps({**json.loads(path.read_text()), "metrics": 5, "model": "lr", "train": [1]}))
    (version,) = checkpoint.overview(d)["versions"]
    assert (version["metrics"], version["model"], version["job"]) == ({}, None, None), version


def test_an_overview_says_how_many_versions_and_status_counts_the_older_ones_from_it(tmp_path, capsys):
    """/v1/models lists the newest 50 of a dir's versions: the web UI said "Versions (50)" of
    210, and `mariana status` "... and 40 older" (50 less the 10 it shows)."""
    from mariana.services.runtime.report import print_versions

    d = tmp_path / "m"
    for _ in range(13):
        checkpoint.save_version(d, {"model": {"kind": "lr"}}, WEIGHTS)
    seen = checkpoint.overview(d, limit=5)
    assert (len(seen["versions"]), seen["versions_total"]) == (5, 13)
    print_versions(str(d), seen["current"], seen["versions"], most=3, total=seen["versions_total"])
    assert "... and 10 older (mariana model list" in capsys.readouterr().out


def test_a_version_changed_after_it_was_written_is_not_loaded(tmp_path, gen_files):
    """A manifest edited to other hashing bits was promoted and served, its pCTRs collapsed (500
    distinct values to 14, AUC 0.71 to 0.49); one flipped bit of the weights (the bias -1.25 to
    -6.8e-20), or another version's weights copied in, was served without a word. A version
    records its manifest's and files' sha256 when it is written, and a load checks them."""
    import json

    from safetensors.numpy import load_file, save_file

    d = tmp_path / "m"
    trained("lr", gen_files["train"]).save(str(d))
    vdir = d / "v000001"
    manifest_path, weights = vdir / checkpoint.MANIFEST, vdir / checkpoint.WEIGHTS
    text, data = manifest_path.read_text(), weights.read_bytes()
    manifest = json.loads(text)
    assert set(manifest["sha256"]) == {"manifest", checkpoint.WEIGHTS, checkpoint.OPTIMIZER}
    manifest_path.write_text(json.dumps(manifest))  # laid out otherwise, the same content: still loads
    ModelBundle.load(str(d))
    manifest["config"]["hashing"]["bits"] += 1
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ModelDirError, match=r"v000001/manifest.json: changed since the version was written"):
        ModelBundle.load(str(d))
    manifest_path.write_text(text)
    arrays = load_file(str(weights))
    arrays["dense.bias"] = arrays["dense.bias"].view(np.uint32) ^ np.uint32(1 << 29)
    save_file({k: v.view(np.float32) if v.dtype == np.uint32 else v for k, v in arrays.items()}, str(weights))
    for load in (lambda: ModelBundle.load(str(d)), lambda: checkpoint.load_version(d, "v000001")):
        with pytest.raises(ModelDirError, match=r"v000001/weights.safetensors: changed or damaged since the version "
                                                 r"was written \(its sha256 is not the one the manifest recorded\)"):
            load()
    weights.write_bytes(data)
    (vdir / checkpoint.OPTIMIZER).write_bytes((vdir / checkpoint.OPTIMIZER).read_bytes()[:-4] + b"    ")
    ModelBundle.load(str(d))  # scoring reads no optimizer state: a damaged one stops a warm start only
    with pytest.raises(ModelDirError, match="optimizer.safetensors: changed or damaged"):
        ModelBundle.load(str(d), with_optimizer=True)
    del manifest["sha256"]  # a version written before the digests: taken as it is
    manifest["config"]["hashing"]["bits"] -= 1
    manifest_path.write_text(json.dumps(manifest))
    assert ModelBundle.load(str(d)).manifest["version"] == "v000001"


def test_journal_and_manifest_text_python_cannot_parse_is_a_damaged_line_or_an_error(tmp_path):
    """A promotions.jsonl line of a 5,000-digit number, or nested 100,000 deep, crashed
    `train` after CURRENT moved, every `model` command, and a server's start (ValueError and
    RecursionError, which json.loads raises besides JSONDecodeError); in a manifest, the CLI's
    every command that read it."""
    d = tmp_path / "m"
    checkpoint.save_version(d, {"model": {}}, WEIGHTS, reason="trained")
    journal = d / checkpoint.PROMOTIONS
    good = journal.read_text()
    journal.write_text(good + '{"n": ' + "9" * 5000 + "}\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    assert checkpoint.promotions(d) == [json.loads(good)]
    assert checkpoint.save_version(d, {"model": {}}, WEIGHTS, reason="trained") == "v000002"
    assert checkpoint.current_version(d) == "v000002" and len(checkpoint.promotions(d)) == 2
    manifest = d / "v000002" / checkpoint.MANIFEST
    for body, says in (('{"steps": ' + "9" * 5000 + "}", "it holds a number of more than 4300 digits"),
                       ("[" * 100_000 + "]" * 100_000, "it nests too deeply")):
        manifest.write_text(body)
        with pytest.raises(ModelDirError, match=f"v000002/manifest.json: not valid JSON: {says}"):
            checkpoint.read_manifest(d, "v000002")


def test_a_model_dir_link_switched_mid_command_is_followed_once(tmp_path, monkeypatch):
    """A blue/green symlink switched while a command ran: the command followed it anew at each
    step, and a prune removed the other directory's CURRENT version, a promote moved the other
    directory's CURRENT and wrote its journal line into the first."""
    blue, green, live = tmp_path / "blue", tmp_path / "green", tmp_path / "live"
    for d in (blue, green):
        for _ in range(4):
            checkpoint.save_version(d, {"model": {}}, WEIGHTS, reason="trained")
    checkpoint.set_current(blue, "v000001", reason="promoted")
    live.symlink_to(blue)
    green_before = (checkpoint.list_versions(green), (green / "CURRENT").read_text(),
                    (green / checkpoint.PROMOTIONS).read_text())

    def switch_after(name):
        real = getattr(checkpoint, name)

        def switching(*args, **kw):
            out = real(*args, **kw)
            tmp = tmp_path / "next"
            tmp.symlink_to(green if os.readlink(live) == str(blue) else blue)
            os.replace(tmp, live)  # the switch, atomic, right after the command's first look
            return out
        monkeypatch.setattr(checkpoint, name, switching)

    switch_after("_current_to_prune")
    removed = [r["name"] for r in checkpoint.prune(live, keep=1)["removed"]]
    monkeypatch.undo()
    assert removed == ["v000002", "v000003"] and checkpoint.list_versions(blue) == ["v000001", "v000004"]
    live.unlink()
    live.symlink_to(blue)
    switch_after("require_version")
    checkpoint.set_current(live, "v000004", reason="promoted")
    monkeypatch.undo()
    assert checkpoint.current_version(blue) == "v000004" and checkpoint.promotions(blue)[-1]["to"] == "v000004"
    assert (checkpoint.list_versions(green), (green / "CURRENT").read_text(),
            (green / checkpoint.PROMOTIONS).read_text()) == green_before
