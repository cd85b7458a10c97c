"""The README's code runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_handoff_example_runs_as_written(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "Handoff(" in b)
    assert len(example.strip().splitlines()) <= 25, "the README's handoff example should stay short"
    exec(compile(example, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("2 StalenessStats(mean=0.5"), out
