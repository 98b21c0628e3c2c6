"""The image commands end to end on what an exploratory run did to them: an --out that
holds other files is refused before any training, with the files kept."""
from __future__ import annotations

from tests.conftest import run_cli_cases


def test_train_image_and_featurizer_train_refuse_an_out_of_other_files_and_keep_them(tmp_path):
    from mariana.featurizer.shapes import generate_images

    generate_images(tmp_path / "folder", 20, size=28, fmt="png")
    generate_images(tmp_path / "idx", 2010, size=28)
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "notes.txt").write_text("precious")
    cases = [["train", "image", "--data", tmp_path / "folder", "--epochs", "1", "--test-images", "1", "--batch-size",
              "1", "--microbatches", "1", "--out", victim],
             ["featurizer", "train", "--data", tmp_path / "idx", "--epochs", "1", "--out", victim]]
    for code, err in run_cli_cases(cases):
        assert code == 2, err
        assert err.strip().splitlines() == [f"mariana: error: --out {victim}: a directory that holds no featurizer "
                                            "(2 files: notes.txt, sub): --out takes a featurizer directory "
                                            "(replaced), or a new or empty one"], err
    assert (victim / "notes.txt").read_text() == "precious" and (victim / "sub").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "idx", "victim"]
