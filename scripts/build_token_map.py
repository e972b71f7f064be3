"""Write a speculative token map: the K most frequent token ids of a corpus, tokenized with a
model folder's tokenizer (``--speculative-token-map`` of ``scripts/serve.py`` reads it).

    # the embedded default model and its corpus (the stdlib's training files)
    python scripts/build_token_map.py --num-tokens 2048 --output out/token_map_2048.json
    # another model and corpus: files, or folders of files matching --glob
    python scripts/build_token_map.py --model-path /models/Qwen3-Next-80B-A3B-Instruct \\
        --corpus data/ --glob '*.txt' --num-tokens 32768 --output out/hot_tokens.npy

The output's format follows its suffix: ``.json`` (a list), ``.npy``, else one id per line;
ids are written most frequent first (ties by smaller id). Fewer than K ids are written when
fewer distinct tokens occur in the corpus. The engine adds the EOS ids itself.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tqdm import tqdm

from lazyspec.models.loader import load_tokenizer
from lazyspec.server.launch import DEFAULT_MODEL
from lazyspec.token_map import count_token_ids, most_frequent_ids, write_token_map

logger = logging.getLogger("build_token_map")


def corpus_files(paths: list[str] | None, glob: str) -> list[Path]:
    """The corpus: ``paths`` (files, or folders whose files matching ``glob`` are read, sorted),
    or by default the stdlib training files of the default model (validation files held
    out, so that prompts from them stay unseen)."""
    if not paths:
        from lazyspec.training import corpus

        root = corpus.stdlib_root()
        return [root / f for f in corpus.stdlib_files(root) if not corpus.is_validation_file(f)]
    files = []
    for given in map(Path, paths):
        if given.is_dir():
            files += sorted(p for p in given.rglob(glob) if p.is_file())
        elif given.is_file():
            files.append(given)
        else:
            raise ValueError(f"corpus path {str(given)!r} is neither a file nor a folder")
    if not files:
        raise ValueError(f"no corpus file found in {paths} (glob {glob!r})")
    return files


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-path",
        default=str(DEFAULT_MODEL),
        help="Model folder whose tokenizer.json encodes the corpus (default: the embedded model).",
    )
    parser.add_argument(
        "--corpus",
        nargs="+",
        default=None,
        help="Text files or folders (default: the stdlib training files of the embedded model).",
    )
    parser.add_argument("--glob", default="*", help="Files read from a corpus folder.")
    parser.add_argument("--num-tokens", type=int, required=True, help="K: ids to write.")
    parser.add_argument(
        "--output", required=True, help="Map file: .json list, .npy array, else one id per line."
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[int]:
    """Count, write the map, and return its ids (most frequent first)."""
    args = parse_args(argv)
    if args.num_tokens <= 0:
        raise SystemExit(f"error: --num-tokens={args.num_tokens} must be positive")
    tokenizer = load_tokenizer(args.model_path)
    if tokenizer is None:
        raise SystemExit(f"error: no tokenizer.json in {args.model_path!r}")
    files = corpus_files(args.corpus, args.glob)
    texts = (p.read_bytes().decode("utf-8", errors="replace") for p in files)
    bar = tqdm(texts, total=len(files), desc="tokenizing", unit="file")
    counts = count_token_ids(tokenizer, bar, tokenizer.get_vocab_size(with_added_tokens=True))
    ids = most_frequent_ids(counts, args.num_tokens)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    write_token_map(args.output, ids)
    coverage = counts[ids].sum() / max(counts.sum(), 1)
    print(
        f"{args.output}: {len(ids)} ids of {int((counts > 0).sum())} seen, covering "
        f"{coverage:.1%} of {int(counts.sum()):,} tokens in {len(files)} files"
    )
    return [int(i) for i in ids]


if __name__ == "__main__":
    main()
