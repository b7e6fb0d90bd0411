"""bench/common/report.py's write_report, the ending the scripts share: their options as "params"
beside their data in {name}.json, the table and notes in {name}.md, the plot drawn at
{out_dir}/{name}.png, and 0 for the script's exit status."""

import argparse
import json

import pytest


@pytest.fixture(scope="module")
def report(bench):
    return bench("bench.common.report")


def test_write_report_writes_params_data_table_and_notes_and_draws_the_plot_beside_them(report, tmp_path):
    args = argparse.Namespace(threads=3, sides="ours")
    drawn = []
    rows = [{"side": "ours", "tokens/s": 12.5}]
    status = report.write_report("demo", args, {"runs": {"ours": [1, 2]}}, rows, out_dir=str(tmp_path / "out"),
                                 title="A demo", notes="Read me.", plot=drawn.append)
    assert status == 0
    saved = json.loads((tmp_path / "out" / "demo.json").read_text())
    assert saved["params"] == {"threads": 3, "sides": "ours"} and saved["runs"] == {"ours": [1, 2]}
    assert saved["table"] == rows and saved["benchmark"] == "demo"
    md = (tmp_path / "out" / "demo.md").read_text()
    assert md.startswith("# A demo\n") and "| ours |" in md and "Read me." in md
    assert drawn == [tmp_path / "out" / "demo.png"]


def test_write_report_without_a_plot_writes_only_the_two_files(report, tmp_path):
    assert report.write_report("bare", argparse.Namespace(), {}, [], out_dir=tmp_path, title="Bare") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare.json", "bare.md"]
