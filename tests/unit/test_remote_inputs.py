"""The loader's side of `coordinator.data_via_loader` (services/remote_inputs.py): the
held-out rows it sends are exactly the rows local mode scores, header first; a whole file
goes as it is; a job's check answers what `check_request` would."""
from __future__ import annotations

import gzip

import pytest

from mariana.services.assemble import check_request
from mariana.services.remote_inputs import check_on_loader, file_parts, holdout_parts
from mariana.sparse.errors import MarianaError
from mariana.trainer.data import RowRange


def lines(n: int, tag: str) -> list[bytes]:
    return [f"{i % 2}\t{tag}{i}".encode() for i in range(n)]


@pytest.mark.parametrize("header", [False, True])
@pytest.mark.parametrize("fraction", [0.05, 0.3, 0.7])
def test_holdout_rows_are_the_tail_local_mode_scores(tmp_path, header, fraction):
    a, b = lines(37, "a"), lines(23, "b")
    paths = [tmp_path / "a.tsv", tmp_path / "b.tsv.gz"]
    head = [b"label\tid"] if header else []
    paths[0].write_bytes(b"\n".join(head + a) + b"\n")
    paths[1].write_bytes(gzip.compress(b"\n".join(head + b)))  # no final newline either
    _, valid = RowRange.of_files([str(p) for p in paths], fraction, header)
    got = b"".join(holdout_parts([str(p) for p in paths], valid.__dict__)).split(b"\n")
    assert got[-1] == b""
    want = head + (a + b)[valid.start:valid.stop]
    assert got[:-1] == want and len(want) - len(head) == valid.rows


def test_a_parquet_holdout_is_refused_with_what_to_do_instead(tmp_path):
    p = tmp_path / "x.parquet"
    p.write_bytes(b"PAR1")
    with pytest.raises(MarianaError, match="valid-data"):
        next(holdout_parts([str(p)], {"offsets": {str(p): 0}, "start": 0, "stop": 1, "headers": {str(p): 0}}))


def test_a_file_goes_as_it_is(tmp_path):
    p = tmp_path / "t.tsv.gz"
    blob = gzip.compress(b"".join(b"1\tx%d\n" % i for i in range(200_000)))
    p.write_bytes(blob)
    assert b"".join(file_parts(str(p))) == blob


def test_the_check_answers_what_check_request_would(tmp_path):
    data = tmp_path / "train.tsv"
    data.write_text("".join(f"{i % 2}\t{i}" + "\t" * 38 + "\n" for i in range(100)))
    body = {"data": [str(data)], "out": str(tmp_path / "m"), "config": {"train": {"valid_fraction": 0.2}}}
    got = check_on_loader(body)
    request, spec = check_request(body)
    assert got["error"] == "" and got["request"] == request and got["spec"] == spec.to_dict()
    assert got["request"]["holdout"]["rows"]["start"] == 80 and got["size"] == data.stat().st_size * 80 // 100
    assert "no such file" in check_on_loader({**body, "data": [str(tmp_path / "nope.tsv")]})["error"]
    assert "unknown job key" in check_on_loader({**body, "bogus": 1})["error"]


def test_a_dnn_jobs_auto_batch_is_shared_by_the_clusters_workers(tmp_path):
    """With W workers a DNN job's "auto" batch is that of rows / W (`resolve_auto`), on the
    coordinator and on the loader alike; LR's and a batch the user gave stay."""
    data = tmp_path / "train.tsv"
    data.write_text(("0\t1" + "\t" * 38 + "\n") * 300_000)

    def batch(model: str, workers: int, **train) -> tuple[int, int]:
        body = {"data": [str(data)], "out": str(tmp_path / "m"), "config": {"model": {"kind": model}, "train": train}}
        checked = check_on_loader(body, workers)
        assert checked["error"] == "", checked["error"]
        return check_request(body, workers)[1].config.train.batch_size, checked["spec"]["config"]["train"]["batch_size"]

    assert batch("dnn", 1) == (2048, 2048)
    assert batch("dnn", 2) == (1024, 1024)
    assert batch("dnn", 4) == (512, 512)
    assert batch("lr", 2) == (2048, 2048)
    assert batch("dnn", 2, batch_size=4096) == (4096, 4096)
