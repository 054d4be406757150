"""benchmarks/_table.py: the shared tail of every benchmark script (print the table, write it)."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

from _table import RESULTS, results_path, write_results  # noqa: E402


def test_write_results_writes_and_prints(tmp_path, capsys):
    out = tmp_path / "new" / "x.md"
    assert write_results(out, ["# X", "", "| a |", ""]) == out
    assert out.read_text() == "# X\n\n| a |\n"
    assert capsys.readouterr().out == f"# X\n\n| a |\n\nwrote {out}\n"
    write_results(str(out), "text\n", show=["summary"])
    assert out.read_text() == "text\n" and capsys.readouterr().out == f"summary\nwrote {out}\n"
    write_results(out, "quiet", show=())
    assert capsys.readouterr().out == f"wrote {out}\n"


def test_results_path_is_under_benchmarks_results():
    assert results_path("step_time") == RESULTS / "step_time.md" and RESULTS.name == "results"
    assert (RESULTS / "step_time.md").exists()
