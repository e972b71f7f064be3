"""The kernel benchmark keeps a failed kernel's or peer's whole error message."""

from lazyspec.bench.kernels import Table, measure


def test_a_failed_row_keeps_the_whole_message(tmp_path):
    message = "first line\n" + "x" * 300 + "\nlast line of a long peer traceback"

    def fails():
        raise RuntimeError(message)

    table = Table(tmp_path / "kernels.md", "header")
    table.add(measure({"kernel": "state", "B": 1}, 10, 1.0, fails))
    table.add(measure({"kernel": "state", "B": 2}, 10**9, 1000.0, lambda: 1e-3))
    text = (tmp_path / "kernels.md").read_text()
    assert "error E1: RuntimeError: first line" in text
    assert message in text  # the whole message, under the table
    assert "| state |  | 2 |" in text and "1000.0" in text
