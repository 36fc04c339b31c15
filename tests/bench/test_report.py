"""docs/performance.md is exactly what ``bench/report.py render`` makes of the committed results,
and every table on it says where it was measured."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from bench import report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_page_is_the_rendering_of_the_committed_results():
    results = report.load_results()
    assert {"padding", "plan"} <= set(results), sorted(results)
    with open(report.PAGE, encoding="utf-8") as f:
        page = f.read()
    assert page == report.render(results), "docs/performance.md is stale: run python3 bench/report.py render"


@pytest.mark.parametrize("path", sorted(report.BLOCK_PAGES), ids=os.path.basename)
def test_the_generated_tables_of_a_docs_page_are_the_rendering_of_the_committed_results(path):
    with open(path, encoding="utf-8") as f:
        page = f.read()
    assert page == report.with_block(page, report.render_block(report.load_results(), report.BLOCK_PAGES[path])), (
        f"{os.path.relpath(path, report.ROOT)}'s generated tables are stale: run python3 bench/report.py render")


def test_every_table_has_one_header_line_with_commit_machine_command_and_date():
    with open(report.PAGE, encoding="utf-8") as f:
        lines = f.read().splitlines()
    tables = [i for i, line in enumerate(lines) if line.startswith("|") and not lines[i - 1].startswith("|")]
    assert tables
    for i in tables:  # the header is the last line above the table that starts with *commit (a caption may follow it)
        head = next(lines[j] for j in range(i - 1, max(i - 5, 0), -1) if lines[j].startswith("*commit"))
        assert re.fullmatch(r"\*commit `[0-9a-f]{7,40}[^`]*`, \d+ CPUs \([^)]+\), torch \S+, Python \S+; `python3 bench/"
                            r"\w+\.py[^`]*`; \d{4}-\d\d-\d\d\*", head), (i, head)


def test_every_result_names_its_run():
    for name, result in report.load_results().items():
        assert result["name"] == name and result["script"] in report.RENDERERS, name
        assert result["command"].split()[1] == result["script"], result["command"]
        assert set(result["machine"]) >= {"cpus", "torch", "python", "cuda"}
        assert not result["uncommitted_changes"], f"{name}: measured with uncommitted changes to ragged/ or its script"


def test_record_saves_what_the_benchmark_wrote(tmp_path, monkeypatch):
    """``record`` appends --json to the command and keeps the benchmark's own output."""
    monkeypatch.setattr(report, "RESULTS", str(tmp_path))
    out = report.record("padding", [sys.executable, "bench/padding.py", "--models", "llama3-70b", "--world-sizes", "8",
                                    "--granularities", "rows:1"])
    assert out["script"] == "bench/padding.py" and len(out["data"]) == 1 and out["data"][0]["m"] == 8
    page = report.render({"padding": json.loads(json.dumps(out))})
    assert "| llama3-70b | rows:1 | 8 |" in page


def test_a_result_without_a_section_is_refused():
    results = report.load_results()
    some = next(iter(results.values()))
    with pytest.raises(SystemExit):
        report.render({**results, "unplaced": some})


def test_render_check_fails_on_a_stale_page(tmp_path, monkeypatch):
    page = tmp_path / "performance.md"
    page.write_text("stale\n")
    monkeypatch.setattr(report, "PAGE", str(page))
    assert report.main(["render", "--check"]) == 1
    assert report.main(["render"]) == 0 and report.main(["render", "--check"]) == 0
