"""The package is laid out as the data flows: no stage imports a later one."""

from __future__ import annotations

import ast
import pathlib

import spmd_compiler

STAGES = ["trace", "expand", "rebuild", "optimize", "driver", "pipeline", "runtime"]
ROOT = pathlib.Path(spmd_compiler.__file__).parent


def _imported_stages(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[int, str]]:
    """(line, stage) of every import of a stage package in ``path`` (a file under ``root``)."""
    rel = path.relative_to(root).parts
    package = list(rel[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package[: len(package) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            names = [a.name for a in node.names]
            for t in [target] if target else [[n] for n in names]:
                if t and t[0] in STAGES:
                    out.append((node.lineno, t[0]))
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "spmd_compiler" and len(parts) > 1 and parts[1] in STAGES:
                    out.append((node.lineno, parts[1]))
    return out


def test_no_stage_imports_a_later_one() -> None:
    checked, violations = 0, []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).parts
        if len(rel) < 2 or rel[0] not in STAGES:
            continue
        me = STAGES.index(rel[0])
        for line, stage in _imported_stages(path):
            checked += 1
            if STAGES.index(stage) > me:
                violations.append(f"{'/'.join(rel)}:{line} ({rel[0]}) imports {stage}")
    assert checked > 50, f"found only {checked} stage imports; the checker no longer sees the package"
    assert not violations, "a stage imports a later one:\n" + "\n".join(violations)


def test_checker_sees_a_backward_import(tmp_path: pathlib.Path) -> None:
    """The checker itself: an import of a later stage is found."""
    (tmp_path / "expand").mkdir()
    probe = tmp_path / "expand" / "probe.py"
    probe.write_text("from ..runtime import compile\nfrom .. import pipeline\nimport spmd_compiler.driver.io\n")
    assert _imported_stages(probe, tmp_path) == [(1, "runtime"), (2, "pipeline"), (3, "driver")]
