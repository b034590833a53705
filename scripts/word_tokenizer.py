"""A word-level tokenizer made from your own texts, offline: a Hugging Face tokenizer folder for
the text classifier's --tokenizer (examples/text_classification) where no hub tokenizer can be
downloaded, or to try the example on a laptop before picking a checkpoint.

    python scripts/word_tokenizer.py reviews.csv tokenizers/reviews                 # column "text"
    python scripts/word_tokenizer.py reviews.jsonl tokenizers/reviews --column body --min_count 2

It keeps every word (BERT's lower-casing and punctuation split) seen at least --min_count times, plus
BERT's special tokens; other words become [UNK]. The folder loads with
AutoTokenizer.from_pretrained(folder). A hub checkpoint's own tokenizer (--hf_model) needs none.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def build_tokenizer(texts, folder: Path, min_count: int = 1) -> Path:
    """Save a BERT word-level tokenizer of the words in `texts` to `folder`."""
    from tokenizers.pre_tokenizers import BertPreTokenizer
    from transformers import BertTokenizerFast

    splitter = BertPreTokenizer()  # the split BertTokenizerFast makes, on lower-cased text
    counts = collections.Counter(
        word for text in texts for word, _ in splitter.pre_tokenize_str(str(text).lower())
    )
    words = sorted(word for word, count in counts.items() if count >= min_count)
    vocabulary = {word: index for index, word in enumerate([*SPECIAL, *words])}
    BertTokenizerFast(vocab=vocabulary).save_pretrained(folder)
    return folder


def read_texts(path: Path, column: str) -> list[str]:
    import datasets

    builder = BUILDERS.get(path.suffix)
    if builder is None:
        sys.exit(f"error: {path}: a .csv, .json, .jsonl or .parquet file holds the texts")
    table = datasets.load_dataset(builder, data_files=str(path), split="train")
    if column not in table.column_names:
        sys.exit(f"error: {path} has no column '{column}' (it has {', '.join(table.column_names)})")
    return table[column]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("texts", type=Path, help="a .csv, .json, .jsonl or .parquet file")
    parser.add_argument("out", type=Path, help="the tokenizer folder to write")
    parser.add_argument("--column", default="text", help="the column holding the texts")
    parser.add_argument("--min_count", type=int, default=1, help="keep words seen this often")
    args = parser.parse_args(argv)
    folder = build_tokenizer(read_texts(args.texts, args.column), args.out, args.min_count)
    print(f"wrote {folder}: --tokenizer {folder}")


if __name__ == "__main__":
    main()
