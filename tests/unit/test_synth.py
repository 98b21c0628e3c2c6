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
