"""The weight-layout benchmark (``benchmarks/tools/bench_layout.py``) in its CPU smoke mode: every
form of both cases, in both layouts, is checked against its float32 reference and timed
from the profiler's trace."""

from __future__ import annotations

from pathlib import Path


def table(path: Path) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in path.read_text().splitlines()
        if line.startswith(("| experts", "| dense"))
    ]


def test_bench_layout_smoke_checks_both_layouts(tmp_path, load_tool):
    bench = load_tool("bench_layout")
    out = tmp_path / "layout.md"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    rows = table(out)
    for case, layouts in (
        ("experts", ("[E, in, out]", "[E, out, in]")),
        ("dense", ("[in, out]", "[out, in]")),
    ):
        forms = [row[1] for row in rows if row[0] == case]
        for layout in layouts:
            assert any(form.endswith(layout) for form in forms), (case, layout, forms)
    assert any(row[1].startswith("XLA dot") for row in rows)
    for row in rows:
        assert row[7].startswith("ok"), row
        assert float(row[3]) > 0.0 and float(row[5]) > 0.0, row
    assert "floor: the weight bytes" in out.read_text()


def test_bench_layout_fails_a_form_that_reads_the_wrong_block(tmp_path, monkeypatch, load_tool):
    """A rows-layout loop whose block comes out with its output columns in another order
    gives other products: the check says so, the strips' forms stay ok, the run fails."""
    bench = load_tool("bench_layout")
    right = bench._product

    def rows_reversed(xs, w, rows_layout):  # the block's output columns in reverse
        return right(xs, w[::-1] if rows_layout else w, rows_layout)

    monkeypatch.setattr(bench, "_product", rows_reversed)
    out = tmp_path / "layout.md"
    assert bench.main(["--smoke", "--out", str(out)]) == 1
    rows = table(out)
    assert any(row[7].startswith("MISMATCH") for row in rows if "out, in]" in row[1])
    assert all(row[7].startswith("ok") for row in rows if row[1].endswith("in, out]"))


def test_bench_layout_keeps_a_form_that_fails_as_a_row(tmp_path, monkeypatch, load_tool):
    """A form that does not compile (here: every Pallas rows-layout dense form) is a row of
    the table with no time and the error as its check, the other forms are timed, and the
    run fails."""
    bench = load_tool("bench_layout")
    right = bench.dense_form

    def dense_form(opts, block, block_k, rows_layout, warps, stages):
        fn = right(opts, block, block_k, rows_layout, warps, stages)
        if not rows_layout:
            return fn

        def fails(x, w):
            raise RuntimeError("Shared memory size limit exceeded: requested 2, available 1")

        return fails

    monkeypatch.setattr(bench, "dense_form", dense_form)
    out = tmp_path / "layout.md"
    assert bench.main(["--smoke", "--out", str(out)]) == 1
    rows = table(out)
    failed = [row for row in rows if row[1] == "Pallas rows [out, in]"]
    assert failed, rows
    for row in failed:
        assert row[3] == "-" and row[6] == "-", row
        want = "FAILED RuntimeError: Shared memory size limit exceeded: requested 2, available 1"
        assert row[7] == want, row
    others = [row for row in rows if row[1] != "Pallas rows [out, in]"]
    assert others and all(row[7].startswith("ok") and float(row[3]) > 0 for row in others)


def test_bench_layout_runs_the_named_cases(tmp_path, load_tool):
    """``--cases dense`` runs the dense case alone (every form timed and checked, the run
    passes); an unknown case is refused before anything runs."""
    import pytest

    bench = load_tool("bench_layout")
    out = tmp_path / "layout.md"
    assert bench.main(["--smoke", "--out", str(out), "--cases", "dense"]) == 0
    rows = table(out)
    assert rows and {row[0] for row in rows} == {"dense"}
    assert len(rows) == len(bench.parse_args(["--smoke"]).dense_forms) + 2
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--cases", "dense,moe"])
