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


def _python_blocks(text: str) -> list[str]:
    return [block for block in re.findall(r"```python\n(.*?)```", text, flags=re.S)]


def test_readme_example_is_the_quickstart_script():
    """The README's example is examples/quickstart.py, verbatim (the run below runs it)."""
    readme = (ROOT / "README.md").read_text()
    blocks = _python_blocks(readme)
    assert len(blocks) == 1, blocks
    assert blocks[0] == (ROOT / "examples" / "quickstart.py").read_text()
    assert len([line for line in blocks[0].splitlines() if line.strip()]) <= 26


def test_quickstart_runs_as_written_and_exits_cleanly():
    """torchrun on 2 gloo processes (dp 1 x tp 2): progress lines, five losses, exit 0."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPMD_COMPILER_LOGS": "+progress", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(ROOT / "examples" / "quickstart.py")],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "spmd_compiler: compiling train_step for 2 ranks (dp=1, tp=2): first call" in run.stderr, run.stderr[-3000:]
    assert "spmd_compiler: compiled train_step in" in run.stderr
    assert run.stderr.count("spmd_compiler: compiling") == 1  # one compile: the optimizer state exists before the trace
    losses = [float(line.split()[-1]) for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 5 and losses[-1] < losses[0], run.stdout
    assert "Traceback" not in run.stderr and "Segmentation" not in run.stderr, run.stderr[-3000:]
