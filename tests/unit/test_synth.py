import numpy as np

from mariana.sparse.parse import Reader
from mariana.sparse.schema import criteo
from mariana.sparse.synth import generate_criteo


def test_generator_is_deterministic_and_parses_cleanly(tmp_path):
    a, b, c = tmp_path / "a.tsv", tmp_path / "b.tsv", tmp_path / "c.tsv.gz"
    ra = generate_criteo(a, 20_000, seed=5)
    generate_criteo(b, 20_000, seed=5)
    generate_criteo(c, 1_000, seed=6)
    assert a.read_bytes() == b.read_bytes()  # same seed, same bytes
    assert 0.20 <= ra["ctr"] <= 0.25
    reader = Reader([str(a), str(c)], criteo())
    chunks = list(reader)
    assert reader.stats.rows_ok == 21_000 and reader.stats.rows_bad == 0
    cols = chunks[0].columns
    assert np.isnan(cols["I1"]).mean() > 0.3               # missing values
    assert max(np.nanmax(cols[f"I{j}"]) for j in range(1, 14)) > 10_000  # heavy tails
    assert (cols["I2"] < 0).any()                          # small negatives
    c3 = cols["C3"].combine_chunks() if hasattr(cols["C3"], "combine_chunks") else cols["C3"]
    counts = np.bincount(c3.indices.to_numpy(zero_copy_only=False))
    assert counts.max() > 20 * np.median(counts)           # Zipf-skewed categories
    line = a.read_text().split("\n", 1)[0].split("\t")
    assert len(line) == 40 and all(len(v) in (0, 8) for v in line[14:])


def test_different_seeds_share_the_planted_model(tmp_path):
    generate_criteo(tmp_path / "x.tsv", 2_000, seed=1)
    generate_criteo(tmp_path / "y.tsv", 2_000, seed=2)
    vocab = lambda p: {ln.split("\t")[14] for ln in p.read_text().splitlines()}  # noqa: E731
    x, y = vocab(tmp_path / "x.tsv"), vocab(tmp_path / "y.tsv")
    assert x != y and len(x & y) > 0.5 * min(len(x), len(y))


def test_a_generator_writes_regular_files_only_and_through_a_link(tmp_path):
    """The output went in through a temp file renamed over it: `--out /dev/stdout` (or
    /dev/full, or a device node) became a regular file, run as root; a named pipe was
    replaced and its reader got nothing; a symbolic link was replaced by a file. Now a link's
    target is written, os.devnull straight, anything else that is not a regular file refused."""
    import os

    import pytest

    from mariana.sparse.errors import MarianaError
    from mariana.sparse.synth import output_file
    from mariana.sparse.synth_drift import generate_drift

    real = tmp_path / "real.tsv"
    real.write_text("old\n")
    (tmp_path / "link.tsv").symlink_to(real)
    info = generate_criteo(tmp_path / "link.tsv", 10, seed=1)
    assert (tmp_path / "link.tsv").is_symlink() and len(real.read_text().splitlines()) == 10
    assert info["path"] == str(real)
    os.mkfifo(tmp_path / "pipe.tsv")
    for gen in (generate_criteo, generate_drift):
        with pytest.raises(MarianaError, match=r"pipe.tsv: is a FIFO \(a named pipe, or a shell's >\(...\)\), not "
                                               "a regular file"):
            gen(tmp_path / "pipe.tsv", 10)
    assert (tmp_path / "pipe.tsv").is_fifo()
    with pytest.raises(MarianaError, match="/dev/zero: is a device, not a regular file"):
        output_file("/dev/zero")  # only looked at: never written
    (tmp_path / "gone.tsv").symlink_to(tmp_path / "nowhere" / "x.tsv")
    with pytest.raises(MarianaError, match="gone.tsv: is a symbolic link to .*, which does not exist"):
        output_file(tmp_path / "gone.tsv")
    with pytest.raises(MarianaError, match="the output file name is empty"):
        output_file("")
    assert output_file(os.devnull) == (os.devnull, True)
    assert generate_criteo(os.devnull, 10)["rows"] == 10 and os.path.exists(os.devnull)
    assert not os.path.isfile(os.devnull)  # still the device
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gone.tsv", "link.tsv", "pipe.tsv", "real.tsv"]


def test_a_generator_that_fails_midway_leaves_the_old_file_and_no_temp_file(tmp_path):
    """Both generators write through `output_stream`: the old file stands until the new one is
    whole, and a missing directory is named before anything is drawn (it was checked by the
    CLI alone, so the Python API wrote nothing and said "No such file" from pyarrow)."""
    import pytest

    from mariana.sparse.errors import MarianaError
    from mariana.sparse.synth_drift import generate_drift

    def stop(done, seconds):
        raise KeyboardInterrupt

    for gen in (generate_criteo, generate_drift):
        old = tmp_path / "old.tsv.gz"
        old.write_bytes(b"old")
        with pytest.raises(KeyboardInterrupt):
            gen(old, 300_000, progress=stop)
        assert old.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["old.tsv.gz"]
        with pytest.raises(MarianaError, match=r"x.tsv: directory .*/no/dir does not exist"):
            gen(tmp_path / "no" / "dir" / "x.tsv", 10)
        # more rows than the disk holds: refused before the first (it wrote until the disk was full)
        with pytest.raises(MarianaError, match=r"old.tsv.gz: 1,000,000,000,000,000 rows take at least 70,000,000.0 GB"
                                               r", and its file system has [0-9,.]+ GB free: ask for fewer rows"):
            gen(old, 10**15)
        assert old.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["old.tsv.gz"]


def test_a_generator_refuses_a_name_of_another_format_and_bad_row_counts(tmp_path):
    """`--out x.parquet` got TSV, `.bz2` plain text; generate_criteo(path, -1) wrote an empty file."""
    import pytest

    from mariana.sparse.errors import MarianaError

    for name in ("x.parquet", "x.tsv.bz2", "x.TSV.GZ"):
        with pytest.raises(MarianaError, match="the generators write text"):
            generate_criteo(tmp_path / name, 10)
    for rows in (-1, 1.5, "10", True):
        with pytest.raises(ValueError, match="rows must be an integer >= 0"):
            generate_criteo(tmp_path / "x.tsv", rows)
    assert not list(tmp_path.iterdir())
