"""What reading a local image folder shows on the console (examples/image_classification/data.py): no
"Downloading data" bar, since nothing is downloaded, and datasets' progress bars as they were after it, for
a hub download's real progress."""

import datasets

from test_example_data import Cfg, example_data, write_image


def test_a_local_image_folder_shows_no_download_bar_and_leaves_the_bars_as_they_were(
    tmp_path, capfd
):
    images = example_data("image_classification")
    # 16 files or more: datasets' download step draws its bar of files (fewer are done one by one)
    for name in ("cat", "dog"):
        for i in range(12):
            write_image(tmp_path / "photos" / name / f"{i}.png", 10 * i)
    assert not datasets.are_progress_bars_disabled()  # the default: a hub download shows its bar
    splits = images.load_images(Cfg(str(tmp_path / "photos")))
    assert splits["train"].num_rows == 24  # read, and freshly: a new folder is a new cache entry
    out, err = capfd.readouterr()
    assert "Downloading" not in out + err, err
    assert not datasets.are_progress_bars_disabled()


def test_bars_that_were_off_stay_off(tmp_path):
    images = example_data("image_classification")
    for name in ("cat", "dog"):
        write_image(tmp_path / "photos" / name / "0.png", 0)
    datasets.disable_progress_bars()
    try:
        images.load_images(Cfg(str(tmp_path / "photos")))
        assert datasets.are_progress_bars_disabled()
    finally:
        datasets.enable_progress_bars()
