"""The text and image classifiers' data.py (examples/text_classification, examples/image_classification)
read in this process, each value against one worked out here: the start-up checks' whole lines, a batch
padded and masked by hand, a text cut to max_length tokens as the tokenizer encodes it alone, a pixel's
normalised value from its colour, the held-out share per class, the warnings and refusals as whole lines.
(Their bad data: tests/test_example_data.py.)"""

import datasets
import pytest
import torch
from PIL import Image

from errors import ConfigError
from test_example_data import Cfg, example_data, write_image

# ---------------------------------------------------------------- the text classifier


def write_reviews(path, rows: list[tuple[str, str]], text_column: str = "text"):
    lines = [f"{text_column},label", *(f'"{text}",{label}' for text, label in rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "change, line",
    [
        (
            {"dataset": ""},
            "dataset: pass --dataset, a CSV or JSON lines file of text and label (or a hub name)",
        ),
        ({"max_length": 0}, "max_length must be > 0 (got 0)"),
        ({"max_length": -3}, "max_length must be > 0 (got -3)"),
        ({"text_column": ""}, "text_column must not be empty (got '')"),
    ],
)
def test_the_text_data_s_keys_are_refused_in_one_whole_line(change, line):
    text = example_data("text_classification")
    cfg = Cfg(**{"dataset": "reviews.csv", **change})
    with pytest.raises(ConfigError) as refused:
        text.check_config(cfg)
    assert str(refused.value) == line


def test_the_smallest_text_keys_pass():
    text = example_data("text_classification")
    assert text.check_config(Cfg("reviews.csv", max_length=1, text_column="t")) is None


def test_a_text_batch_is_padded_to_its_longest_with_a_mask_by_hand():
    text = example_data("text_classification")
    samples = [
        {"input_ids": torch.tensor([5, 6]), "labels": torch.tensor(1)},
        {"input_ids": torch.tensor([7, 8, 9, 10]), "labels": torch.tensor(0)},
        {"input_ids": torch.tensor([11]), "labels": 2},  # a plain int label too
    ]
    batch = text.collate(samples)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].tolist() == [[5, 6, 0, 0], [7, 8, 9, 10], [11, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert batch["labels"].tolist() == [1, 0, 2]
    for key in batch:
        assert batch[key].dtype == torch.long, key


def test_the_bytes_tokenizer_is_refused_for_a_text_classifier():
    text = example_data("text_classification")
    with pytest.raises(ConfigError) as refused:
        text.text_tokenizer(Cfg("reviews.csv", tokenizer_name="bytes"))
    assert str(refused.value) == (
        "tokenizer: a text classifier needs a Hugging Face tokenizer: pass --tokenizer "
        "NAME_OR_FOLDER (e.g. google-bert/bert-base-uncased), or --hf_model CHECKPOINT to use "
        "the checkpoint's own"
    )


def test_encode_cuts_each_text_to_max_length_tokens_of_its_own_encoding(bpe_tokenizer):
    from transformers import AutoTokenizer

    text = example_data("text_classification")
    tokenizer = AutoTokenizer.from_pretrained(bpe_tokenizer)
    texts = ["a rather long review of the film", "ok", 12345]
    full = [tokenizer(str(t))["input_ids"] for t in texts]
    assert len(full[0]) > 3 and len(full[1]) <= 3
    encoded = text.encode({"body": texts, "label": [1, 0, 1]}, tokenizer, "body", 3)
    assert encoded == {"input_ids": [ids[:3] for ids in full], "labels": [1, 0, 1]}
    assert "12345".startswith(tokenizer.decode(encoded["input_ids"][2]))  # the number as text


def test_a_csv_s_texts_become_token_ids_and_sorted_class_numbers(tmp_path, bpe_tokenizer, capfd):
    """Nine reviews, labels by name: the classes in sorted order (bad 0, good 1, meh 2); half held
    out (5 of 9: datasets rounds the test part up), the split datasets' own train_test_split(seed 0)
    makes of the same rows; each sample the tokenizer's ids of its text, cut to 4."""
    from transformers import AutoTokenizer

    text = example_data("text_classification")
    names = ["good", "bad", "meh"]
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"]
    rows = [(f"{word} says {'so ' * i}much", names[i % 3]) for i, word in enumerate(words)]
    path = write_reviews(tmp_path / "reviews.csv", rows, text_column="body")
    cfg = Cfg(
        str(path),
        text_column="body",
        max_length=4,
        eval_fraction=0.5,
        tokenizer_name=str(bpe_tokenizer),
    )
    assert text.class_names(cfg) == ["bad", "good", "meh"]
    train, held_out = text.build_datasets(cfg)
    assert (len(train), len(held_out)) == (4, 5)
    # datasets' progress bar of each part's tokenizing says what it does (its default: "Map")
    bars = capfd.readouterr().err.replace("\r", "\n").splitlines()
    for rows_done in ("4/4", "5/5"):
        assert any(b.startswith("tokenizing: 100%") and rows_done in b for b in bars), bars
    tokenizer = AutoTokenizer.from_pretrained(bpe_tokenizer)
    number = {"bad": 0, "good": 1, "meh": 2}
    expected = {tuple(tokenizer(t)["input_ids"][:4]): number[label] for t, label in rows}
    assert len(expected) == 9  # every text tells itself apart in 4 tokens
    seen = {}
    for part in (train, held_out):
        for sample in part:
            assert set(sample) == {"input_ids", "labels"}
            assert isinstance(sample["input_ids"], torch.Tensor)
            seen[tuple(sample["input_ids"].tolist())] = int(sample["labels"])
    assert seen == expected
    # the held-out rows: datasets' own split of the rows with a fixed seed 0
    alone = datasets.Dataset.from_dict({"i": list(range(9))}).train_test_split(
        test_size=0.5, seed=0
    )
    held = sorted(alone["test"]["i"])
    assert sorted(tuple(s["input_ids"].tolist()) for s in held_out) == sorted(
        tuple(tokenizer(rows[i][0])["input_ids"][:4]) for i in held
    )


@pytest.mark.parametrize("eval_split", ["validation", "test"])
def test_a_validation_or_test_split_is_the_eval_set_whole(bpe_tokenizer, monkeypatch, eval_split):
    """A hub dataset's splits (stood in for by load_texts): the one named validation (or, without
    it, test) is the eval set as it is, and train keeps every row."""
    from transformers import AutoTokenizer

    text = example_data("text_classification")
    classes = datasets.ClassLabel(names=["neg", "pos"])
    features = datasets.Features({"text": datasets.Value("string"), "label": classes})

    def split(words, labels):
        return datasets.Dataset.from_dict({"text": words, "label": labels}, features=features)

    splits = {
        "train": split(["alpha", "bravo", "charlie", "delta"], [0, 1, 0, 1]),
        eval_split: split(["echo", "foxtrot"], [1, 0]),
    }
    if eval_split == "validation":  # with both, validation is the eval set
        splits["test"] = split(["golf"], [1])
    monkeypatch.setattr(text, "load_texts", lambda cfg: datasets.DatasetDict(splits))
    cfg = Cfg("org/reviews", eval_fraction=0.5, tokenizer_name=str(bpe_tokenizer))
    train, held_out = text.build_datasets(cfg)
    tokenizer = AutoTokenizer.from_pretrained(bpe_tokenizer)

    def read(part):
        return sorted(
            (tokenizer.decode(sample["input_ids"].tolist()), int(sample["labels"]))
            for sample in part
        )

    assert read(train) == [("alpha", 0), ("bravo", 1), ("charlie", 0), ("delta", 1)]
    assert read(held_out) == [("echo", 1), ("foxtrot", 0)]


def label_splits(**columns) -> datasets.DatasetDict:
    return datasets.DatasetDict(
        {name: datasets.Dataset.from_dict({"label": values}) for name, values in columns.items()}
    )


def test_a_bad_label_of_a_hub_split_names_the_split_and_the_row():
    text = example_data("text_classification")
    splits = label_splits(train=[0, 1, 1], validation=[1, 0, None, 1])
    with pytest.raises(ConfigError) as refused:
        text.check_labels(splits, Cfg("org/reviews"), [])
    assert str(refused.value) == (
        "dataset: split 'validation', row 3, column 'label': the label is empty; every row needs "
        "its class (a name or an integer)"
    )


def test_a_label_outside_a_hub_split_s_classes_names_the_split_and_the_row():
    """A hub dataset's ClassLabel column holding 2 of two classes (datasets itself refuses to
    build one; an arrow table read as it is): the split, the row, the classes."""
    import pyarrow as pa

    text = example_data("text_classification")
    features = datasets.Features({"label": datasets.ClassLabel(names=["neg", "pos"])})
    table = pa.table({"label": pa.array([0, 1, 2, 1], pa.int64())})
    split = datasets.Dataset(table, info=datasets.DatasetInfo(features=features))
    with pytest.raises(ConfigError) as refused:
        text.check_labels(datasets.DatasetDict({"train": split}), Cfg("org/reviews"), [])
    assert str(refused.value) == (
        "dataset: split 'train', row 3, column 'label': the label 2 is outside the classes 0..1 "
        "(neg, pos)"
    )


def test_a_label_that_is_not_a_number_is_empty_and_an_integral_float_is_a_label():
    text = example_data("text_classification")
    classes = datasets.ClassLabel(names=["neg", "pos"])
    assert text.label_problem(float("nan"), None).startswith("the label is empty")
    assert text.label_problem(None, None).startswith("the label is empty")
    assert text.label_problem(2.0, None) is None  # an integer written 2.0
    assert text.label_problem(-2.5, None) == (
        "the label -2.5 is not an integer (labels are class names or integers)"
    )
    assert text.label_problem(0, classes) is None and text.label_problem(1, classes) is None
    assert text.label_problem(7, None) is None  # numbers of their own: any integer


def test_a_row_is_found_by_its_file_s_own_line_or_row(tmp_path):
    """Rows counted across files read one after another: a CSV's line after its header, a JSON lines
    file's line, a parquet file's row; a row past them all is said as the rest."""
    text = example_data("text_classification")
    csv = write_reviews(tmp_path / "a.csv", [("x", "0"), ("y", "1")])  # rows 0, 1
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text("".join(f'{{"text": "t{i}", "label": {i % 2}}}\n' for i in range(3)))
    parquet = tmp_path / "c.parquet"
    datasets.Dataset.from_dict({"text": ["p", "q"], "label": [0, 1]}).to_parquet(str(parquet))
    files = [csv, jsonl, parquet]
    assert text.row_in_files(0, files) == f"{csv}, line 2 (row 1 after the header)"
    assert text.row_in_files(1, files) == f"{csv}, line 3 (row 2 after the header)"
    assert text.row_in_files(2, files) == f"{jsonl}, line 1"
    assert text.row_in_files(4, files) == f"{jsonl}, line 3"
    assert text.row_in_files(5, files) == f"{parquet}, row 1"
    assert text.row_in_files(6, files) == f"{parquet}, row 2"
    assert text.row_in_files(8, files) == "row 2"  # 7 rows in all: the second past them


# ---------------------------------------------------------------- the image classifier


@pytest.mark.parametrize(
    "change, line",
    [
        (
            {"dataset": ""},
            "dataset: pass --dataset, a folder of images with one subfolder per class (or a hub name)",
        ),
        ({"image_size": 0}, "image_size must be > 0 (got 0)"),
    ],
)
def test_the_image_data_s_keys_are_refused_in_one_whole_line(change, line):
    images = example_data("image_classification")
    with pytest.raises(ConfigError) as refused:
        images.check_config(Cfg(**{"dataset": "photos", **change}))
    assert str(refused.value) == line


def test_the_smallest_image_size_passes():
    images = example_data("image_classification")
    assert images.check_config(Cfg("photos", image_size=1)) is None


def test_an_image_batch_stacks_its_pixels_and_labels():
    images = example_data("image_classification")
    first, second = torch.full((3, 2, 2), 1.5), torch.full((3, 2, 2), -2.0)
    batch = images.collate([{"pixels": first, "labels": 1}, {"pixels": second, "labels": 0}])
    assert set(batch) == {"pixels", "labels"}
    assert batch["pixels"].shape == (2, 3, 2, 2)
    assert batch["pixels"][0].eq(1.5).all() and batch["pixels"][1].eq(-2.0).all()
    assert batch["labels"].tolist() == [1, 0] and batch["labels"].dtype == torch.long


def png_bytes(image) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_pixels_are_rgb_resized_and_normalised_by_hand(tmp_path):
    """One colour a picture, so any resize keeps it: (255, 0, 51) is (1 - 0.5) / 0.25 = 2,
    (0 - 0.5) / 0.25 = -2 and (0.2 - 0.5) / 0.25 = -1.2; a grey level 102 (0.4) is -0.4 in each of
    the three channels RGB gives it. From stored bytes and from a path."""
    images = example_data("image_classification")
    colour = tmp_path / "red.png"
    Image.new("RGB", (5, 3), (255, 0, 51)).save(colour)
    grey = Image.new("L", (2, 2), 102)
    rows = {
        "img": [{"bytes": None, "path": str(colour)}, {"bytes": png_bytes(grey), "path": None}],
        "fine": [3, 1],
    }
    out = images.to_tensors(rows, image_column="img", label_column="fine", size=4)
    assert out["labels"] == [3, 1]
    first, second = out["pixels"]
    assert first.shape == (3, 4, 4) and second.shape == (3, 4, 4)
    for channel, value in enumerate((2.0, -2.0, -1.2)):
        torch.testing.assert_close(first[channel], torch.full((4, 4), value))
    torch.testing.assert_close(second, torch.full((3, 4, 4), -0.4))


def test_an_unreadable_stored_image_is_one_line_naming_it(tmp_path):
    images = example_data("image_classification")
    with pytest.raises(ConfigError) as refused:
        images.open_image({"bytes": b"not an image", "path": None})
    assert str(refused.value).startswith(
        "image an image stored in the dataset cannot be read: cannot identify image file"
    )
    missing = tmp_path / "gone.png"
    with pytest.raises(ConfigError) as refused:
        images.open_image({"bytes": None, "path": str(missing)})
    assert str(refused.value).startswith(f"image {missing} cannot be read: ")


def labelled(counts: list[int]) -> datasets.Dataset:
    names = [f"c{k}" for k in range(len(counts))]
    labels = [k for k, count in enumerate(counts) for _ in range(count)]
    features = datasets.Features(
        {"i": datasets.Value("int64"), "label": datasets.ClassLabel(names=names)}
    )
    return datasets.Dataset.from_dict(
        {"i": list(range(len(labels))), "label": labels}, features=features
    )


@pytest.mark.parametrize(
    "counts, fraction, per_class",
    [
        ([6, 6], 1 / 3, [2, 2]),  # 4 of 12, 2 of each class
        ([9, 3], 1 / 3, [3, 1]),  # 4 of 12, a third of each
        ([10, 10, 10], 0.01, [1, 1, 1]),  # round(0.3) = 0: one image of each class all the same
    ],
)
def test_the_eval_images_are_the_same_share_of_every_class(counts, fraction, per_class):
    images = example_data("image_classification")
    train, held_out = images.hold_out(labelled(counts), "label", fraction)
    held = [list(held_out["label"]).count(k) for k in range(len(counts))]
    assert held == per_class
    assert len(train) == sum(counts) - sum(per_class)
    # which images: datasets' own stratified split of the rows with the fixed seed 0
    own = labelled(counts).train_test_split(
        test_size=sum(per_class), seed=0, stratify_by_column="label"
    )
    assert list(held_out["i"]) == list(own["test"]["i"])
    assert sorted(list(train["i"]) + list(held_out["i"])) == list(range(sum(counts)))


def test_a_class_of_one_image_is_held_out_as_the_images_come():
    """Stratified, a class of one image cannot be in both parts: datasets' plain split of the
    rows (seed 0) at max(round(0.5 x 9), 3) = 4 eval images (round(4.5) is 4; datasets' own
    default share, 0.25, would hold out 3)."""
    images = example_data("image_classification")
    rows = labelled([4, 4, 1])
    train, held_out = images.hold_out(rows, "label", 0.5)
    assert (len(train), len(held_out)) == (5, 4)
    plain = rows.train_test_split(test_size=4, seed=0)
    assert list(held_out["i"]) == list(plain["test"]["i"])
    assert list(train["i"]) == list(plain["train"]["i"])


def test_a_class_without_an_eval_image_is_one_warning_line(capsys, monkeypatch):
    images = example_data("image_classification")
    monkeypatch.delenv("RANK", raising=False)
    held_out = labelled([2, 0, 1, 0])  # c1 and c3 have none
    images.say_missing_classes(held_out, "label")
    assert capsys.readouterr().err == (
        "warning: the eval set holds no image of class c1, c3: no accuracy/<class> for it (add "
        "images to its validation folder, or raise eval_fraction)\n"
    )
    images.say_missing_classes(labelled([1, 1]), "label")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "1")  # said by the first process only
    images.say_missing_classes(held_out, "label")
    assert capsys.readouterr().err == ""


def test_split_folders_give_the_eval_set_and_sorted_class_names(tmp_path, capsys):
    """photos/train and photos/validation: the validation folder is the eval set, whole; the classes
    the subfolders' names, sorted; each sample 3 x image_size x image_size."""
    images = example_data("image_classification")
    folder = tmp_path / "photos"
    for name, color in (("zebra", 200), ("ant", 40)):
        for i in range(3):
            write_image(folder / "train" / name / f"{i}.png", color)
        write_image(folder / "validation" / name / "0.png", color)
    cfg = Cfg(str(folder), image_size=5, eval_fraction=0.5)
    assert images.class_names(cfg) == ["ant", "zebra"]
    train, held_out = images.build_datasets(cfg)
    assert (len(train), len(held_out)) == (6, 2)
    sample = held_out[0]
    assert sample["pixels"].shape == (3, 5, 5)
    # red 200 of ant 40 and zebra 200: the class tells the colour
    red = {1: (200 / 255 - 0.5) / 0.25, 0: (40 / 255 - 0.5) / 0.25}
    for part in (train, held_out):
        for k in range(len(part)):
            got = part[k]
            assert float(got["pixels"][0, 0, 0]) == pytest.approx(red[got["labels"]], abs=1e-6)
    assert sorted(held_out[k]["labels"] for k in range(2)) == [0, 1]
    assert "warning" not in capsys.readouterr().err


def test_a_folder_without_split_folders_holds_out_eval_fraction_of_each_class(tmp_path, capsys):
    images = example_data("image_classification")
    folder = tmp_path / "photos"
    for name in ("cat", "dog"):
        for i in range(5):
            write_image(folder / name / f"{i}.png", 10 * i)
    train, held_out = images.build_datasets(Cfg(str(folder), eval_fraction=0.2))
    assert (len(train), len(held_out)) == (8, 2)  # round(0.2 x 10) = 2: one of each
    assert sorted(held_out[k]["labels"] for k in range(2)) == [0, 1]
    assert "warning" not in capsys.readouterr().err


def test_each_split_folder_needs_two_classes_and_hidden_folders_are_not_classes(
    tmp_path, monkeypatch, capsys
):
    images = example_data("image_classification")
    monkeypatch.delenv("RANK", raising=False)
    folder = tmp_path / "photos"
    for name in ("cat", "dog"):
        write_image(folder / "train" / name / "deep" / "0.png", 1)  # a file further down counts
    write_image(folder / "validation" / "cat" / "0.png", 1)
    write_image(folder / "validation" / ".cache" / "0.png", 1)  # hidden: not a class
    (folder / "validation" / "dog").mkdir()
    with pytest.raises(ConfigError) as refused:
        images.check_class_folders(str(folder))
    assert str(refused.value) == (
        f"dataset '{folder}': {folder / 'validation'} has one class folder (cat); a classifier "
        "needs two or more, one subfolder per class"
    )
    assert capsys.readouterr().err == (
        f"warning: class folder {folder / 'validation' / 'dog'} holds no image: it is not a class "
        "of this run\n"
    )
    monkeypatch.setenv("RANK", "1")  # said by the first process only
    with pytest.raises(ConfigError):
        images.check_class_folders(str(folder))
    assert capsys.readouterr().err == ""
    write_image(folder / "validation" / "dog" / "0.png", 1)
    assert images.check_class_folders(str(folder)) is None


def test_the_image_and_label_columns_are_found_by_their_types():
    images = example_data("image_classification")
    features = datasets.Features(
        {
            "id": datasets.Value("int64"),
            "img": datasets.Image(),
            "coarse_label": datasets.ClassLabel(names=["a", "b"]),
            "fine_label": datasets.ClassLabel(names=["x", "y", "z"]),
        }
    )
    rows = datasets.Dataset.from_dict(
        {"id": [], "img": [], "coarse_label": [], "fine_label": []}, features=features
    )
    assert images.columns_of(rows, "org/pictures") == ("img", "coarse_label")
    plain = datasets.Dataset.from_dict({"img": ["a.png"], "label": [3]})
    unlabelled = datasets.Dataset.from_dict(
        {"img": [], "label": []},
        features=datasets.Features({"img": datasets.Image(), "label": datasets.Value("int64")}),
    )
    for rows in (plain, unlabelled):  # neither column, or images without class labels
        with pytest.raises(ConfigError) as refused:
            images.columns_of(rows, "org/pictures")
        assert str(refused.value) == (
            "dataset 'org/pictures' has no image column and class label column (columns: img, "
            "label): keep one subfolder per class"
        )


def test_a_test_split_folder_is_the_eval_set_without_a_validation_one(tmp_path):
    images = example_data("image_classification")
    folder = tmp_path / "photos"
    for name in ("ant", "bee"):
        for i in range(4):
            write_image(folder / "train" / name / f"{i}.png", 30)
        write_image(folder / "test" / name / "0.png", 90)  # told apart by their colour
    train, held_out = images.build_datasets(Cfg(str(folder), eval_fraction=0.5))
    assert (len(train), len(held_out)) == (8, 2)
    red = (90 / 255 - 0.5) / 0.25
    assert all(float(held_out[k]["pixels"][0, 0, 0]) == pytest.approx(red) for k in range(2))


def test_a_hub_dataset_without_image_and_label_columns_is_named(monkeypatch):
    """load_images stood in for: a hub dataset of texts; both build_datasets and class_names refuse
    it naming the dataset."""
    images = example_data("image_classification")
    texts = datasets.Dataset.from_dict({"text": ["a cat"], "label": [0]})
    monkeypatch.setattr(images, "load_images", lambda cfg: datasets.DatasetDict({"train": texts}))
    line = (
        "dataset 'org/captions' has no image column and class label column (columns: text, "
        "label): keep one subfolder per class"
    )
    for read in (images.build_datasets, images.class_names):
        with pytest.raises(ConfigError) as refused:
            read(Cfg("org/captions"))
        assert str(refused.value) == line
