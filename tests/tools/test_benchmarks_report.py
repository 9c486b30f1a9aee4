"""BENCHMARKS.md is the current report: at most 500 lines, every JSON it cites is in
benchmarks/ and every file there is cited, every JSON says where it came from, its commands run
today (no removed module, setting or path outside the repository), and each table the runner
reproduces has its section."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPORT = (ROOT / "BENCHMARKS.md").read_text()
sys.path.insert(0, str(ROOT / "tools"))


def _code_blocks() -> list[str]:
    return re.findall(r"```\n(.*?)```", REPORT, re.S)


def test_the_report_is_short():
    assert REPORT.count("\n") <= 500


def test_every_cited_json_exists_and_every_kept_file_is_cited():
    kept = {p.name for p in (ROOT / "benchmarks").iterdir()}
    cited = set(re.findall(r"[\w.-]+_[0-9a-f]{7}\.(?:json|png)", REPORT))  # kept files end in their commit
    assert cited <= kept, sorted(cited - kept)
    assert kept <= cited, sorted(kept - cited)


def test_every_kept_json_says_where_it_came_from():
    for path in (ROOT / "benchmarks").glob("*.json"):
        provenance = json.loads(path.read_text())["provenance"]
        for key in ("command", "gpu_name", "gpu_count", "commit", "date"):
            assert provenance.get(key), (path.name, key)
        assert re.fullmatch(r"[0-9a-f]{7,40}", provenance["commit"]), path.name
        assert path.name.endswith(f"_{provenance['commit'][:7]}.json"), path.name


def test_the_commands_run_today():
    from etp.config import REMOVED_SETTINGS

    for block in _code_blocks():
        assert "-m etp.megatron.train " not in block and "tools/scratch" not in block and "/work/" not in block, block
        assert "../" not in block, block
        for key in REMOVED_SETTINGS:
            assert f"etp.{key}=" not in block, (key, block)
        for tool in re.findall(r"tools/[\w/]+\.py", block):
            assert (ROOT / tool).exists(), tool


def test_each_reproduced_table_has_its_section():
    from repro.steps import build_steps

    for section in {s.section for s in build_steps(4)}:
        assert re.search(rf"^## {re.escape(section)}$", REPORT, re.M), section
