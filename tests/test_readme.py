"""The README's two commands are exactly what CI runs."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    commands = [block.strip() for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)]
    assert len(commands) == 2, commands
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    for command in commands:
        assert command in ci, f"README command not run by .ci/run: {command}"


def test_pyproject_torch_range_matches_readme_pin():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"torch>=2.13,<2.15"' in text
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0" in readme and "`>=2.13,<2.15`" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -q torch==2.14.1" in ci  # the other end of the range is tested too


def test_ci_uses_a_fresh_virtual_environment():
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.count("python3 -m venv") == 2 and ci.count("/bin/activate") == 2
