"""The speculative token map file: its three formats, the errors a bad file or a map without
speculation gives (in ``EngineConfig`` and through ``scripts/serve.py``'s flags), the
completion for a model (EOS ids, order, padding to 128, ids in range) and the most-frequent
count that ``scripts/build_token_map.py`` writes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from lazyspec.config import EngineConfig
from lazyspec.server.launch import build_parser, engine_kwargs
from lazyspec.token_map import (
    TOKEN_MAP_ALIGN,
    draft_token_ids,
    most_frequent_ids,
    read_token_map,
)

ROOT = Path(__file__).resolve().parents[1]
SPEC = dict(speculative_algorithm="NEXTN")


@pytest.mark.parametrize("suffix", [".json", ".npy", ".txt"])
def test_every_format_reads_the_same_ids(tmp_path, suffix):
    ids = [17, 3, 42, 0, 99]
    path = tmp_path / f"map{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(ids))
    elif suffix == ".npy":
        np.save(path, np.asarray(ids, np.int32))
    else:
        path.write_text("# hot tokens\n17\n3\n\n42  # a comment\n0\n99\n")
    assert read_token_map(path).tolist() == ids


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("empty.json", "[]", "holds no token id"),
        ("empty.txt", "\n# nothing\n", "holds no token id"),
        ("dup.json", "[5, 7, 5]", "token id 5 appears 2 times"),
        ("neg.txt", "4\n-1\n", "negative token id -1"),
        ("float.json", "[1, 2.5]", "2.5 is not an integer"),
        ("bool.json", "[1, true]", "True is not an integer"),
        ("dict.json", '{"ids": [1]}', "expected a JSON list"),
        ("broken.json", "[1, 2", "cannot read it"),
        ("word.txt", "12\nthe\n", "line 2: 'the' is not an integer"),
        (
            "huge.txt",
            "3\n123456789012345678901234567890\n",
            "123456789012345678901234567890 is too",
        ),
        ("bad.npy", "not numpy", "cannot read it"),
    ],
)
def test_bad_files_are_refused_with_the_reason(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        read_token_map(path)
    assert str(path) in str(info.value)


def test_float_and_two_dimensional_npy_are_refused(tmp_path):
    for array in (np.arange(4, dtype=np.float32), np.arange(4).reshape(2, 2)):
        np.save(tmp_path / "map.npy", array)
        with pytest.raises(ValueError, match="1-D integer array"):
            read_token_map(tmp_path / "map.npy")


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        read_token_map(tmp_path / "absent.json")


def test_config_refuses_a_map_without_speculation_or_a_bad_file(tmp_path):
    good = tmp_path / "map.json"
    good.write_text("[3, 4]")
    with pytest.raises(ValueError, match="speculative_token_map is set but speculative_algo"):
        EngineConfig(speculative_token_map=str(good))
    bad = tmp_path / "bad.json"
    bad.write_text("[3, 3]")
    with pytest.raises(ValueError, match="appears 2 times"):
        EngineConfig(speculative_token_map=str(bad), **SPEC)
    assert EngineConfig(speculative_token_map=str(good), **SPEC).speculative_token_map == str(good)


def test_serve_flag_reaches_the_config_and_its_errors(tmp_path):
    good = tmp_path / "map.txt"
    good.write_text("5\n6\n")
    args = build_parser().parse_args(
        ["--speculative-algorithm", "NEXTN", "--speculative-token-map", str(good)]
    )
    assert engine_kwargs(args)["speculative_token_map"] == str(good)
    assert EngineConfig(**engine_kwargs(args)).speculative_token_map == str(good)
    alone = engine_kwargs(build_parser().parse_args(["--speculative-token-map", str(good)]))
    with pytest.raises(ValueError, match="speculative_algorithm is None"):
        EngineConfig(**alone)
    help_text = build_parser().format_help()
    assert "--speculative-token-map" in help_text and ".npy" in help_text


def test_completion_adds_eos_sorts_and_pads_by_repeating():
    ids = draft_token_ids(np.array([40, 7, 90]), vocab_size=200, eos_ids=(2, 7))
    assert ids.dtype == np.int32 and len(ids) == TOKEN_MAP_ALIGN
    assert ids[:4].tolist() == [2, 7, 40, 90]
    assert set(ids[4:].tolist()) == {90}
    wide = draft_token_ids(np.arange(3, 3 + TOKEN_MAP_ALIGN), vocab_size=1000, eos_ids=(0,))
    assert len(wide) == 2 * TOKEN_MAP_ALIGN and len(np.unique(wide)) == TOKEN_MAP_ALIGN + 1


def test_completion_refuses_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"token id 160 is outside .* vocabulary \[0, 160\)"):
        draft_token_ids(np.array([3, 160]), vocab_size=160, eos_ids=(2,))


def test_most_frequent_ids_order_ties_and_unseen():
    counts = np.array([0, 5, 9, 5, 0, 1, 9])
    assert most_frequent_ids(counts, 3).tolist() == [2, 6, 1]
    assert most_frequent_ids(counts, 10).tolist() == [2, 6, 1, 3, 5]  # unseen ids never
    with pytest.raises(ValueError, match="k=0"):
        most_frequent_ids(counts, 0)


def _build_token_map_script():
    spec = importlib.util.spec_from_file_location(
        "build_token_map", ROOT / "scripts" / "build_token_map.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("suffix", [".json", ".npy", ".txt"])
def test_build_token_map_writes_the_most_frequent_ids(tmp_path, suffix):
    """A character tokenizer over a tiny corpus: 'a' x 9, 'b' x 5, 'c' x 5, 'd' x 1 over two
    files (and a file the glob skips): the top 3 are a, then b and c by id."""
    from lazyspec.testing.char_tokenizer import char_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    tokenizer = char_tokenizer()
    tokenizer.save(str(model / "tokenizer.json"))
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "one.txt").write_text("aaaabbbcc")
    (data / "sub" / "two.txt").write_text("aaaaabbcccd")
    (data / "skip.md").write_text("dddddddddddddddddddddddd")
    out = tmp_path / f"map{suffix}"
    ids = _build_token_map_script().main(
        ["--model-path", str(model), "--corpus", str(data), "--glob", "*.txt"]
        + ["--num-tokens", "3", "--output", str(out)]
    )
    want = [tokenizer.token_to_id(c) for c in "abc"]
    assert want[0] < want[1] < want[2]
    assert ids == want
    assert read_token_map(out).tolist() == want
    everything = _build_token_map_script().main(
        ["--model-path", str(model), "--corpus", str(data / "one.txt"), str(data / "sub")]
        + ["--num-tokens", "50", "--output", str(tmp_path / "all.txt")]
    )
    assert everything == [tokenizer.token_to_id(c) for c in "abcd"]  # only seen ids
