"""The package is laid out as the data flows: no part imports a later one.

Every top-level part of ``spmd_compiler`` (a subpackage or a module) has a place in
``ORDER``; a module may import its own part and the parts before it, never one after,
whether the import is at module level, inside a function or under ``TYPE_CHECKING``
(an import inside a function breaks no import cycle but is the same dependency).

The order is the stages of the data flow, with the shared bottom (private torch door,
errors, text helpers, the Plan) first, and the parts that run the stages after them:

* ``dump`` reads expanded programs (it imports ``expand`` only) and sits right after it:
  the optimize passes measure with it (``budget_prefetch`` keeps the program under the
  static peak of ``dump.memory_trace``); no stage writes dumps itself, the driver does.
* ``driver`` is the compile-and-run loop (``StepDriver``, ``expand``, ``build_program``,
  the step guard) that ``runtime.CompiledStep`` and ``pipeline.PipelinedStep`` are built
  on, so it comes before ``pipeline`` and ``runtime``.
* ``testing`` may import everything; nothing in the package imports it.
"""

from __future__ import annotations

import ast
import pathlib

import spmd_compiler

ORDER = [
    ["_private_torch", "errors", "_format"],
    ["plan"],
    ["trace"],
    ["expand"],
    ["dump"],
    ["rebuild"],
    ["optimize"],
    ["driver"],
    ["pipeline"],
    ["runtime"],
    ["testing"],
]
LEVEL = {part: level for level, parts in enumerate(ORDER) for part in parts}
TOP = {"__init__", "__main__"}  # the public API and the CLI: may import every part
ROOT = pathlib.Path(spmd_compiler.__file__).parent


def _part(rel: tuple[str, ...]) -> str:
    """The top-level part a file under the package root belongs to."""
    return rel[0][: -len(".py")] if len(rel) == 1 else rel[0]


def _imported_parts(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[int, str, str]]:
    """(line, part, where) of every import of a top-level part of the package in ``path``
    (a file under ``root``), ``where`` being "module", "function" or "type-checking"."""
    rel = path.relative_to(root).parts
    package = list(rel[:-1])
    tree = ast.parse(path.read_text())
    where: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                where.setdefault(id(inner), "function")
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in ast.walk(node):
                where.setdefault(id(inner), "type-checking")
    out = []
    for node in ast.walk(tree):
        targets: list[list[str]] = []
        if isinstance(node, ast.ImportFrom):
            if node.level > 0:
                base = package[: len(package) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == "spmd_compiler":
                base = []
            else:
                continue
            module = node.module.split(".") if node.module else []
            if node.level == 0:
                module = module[1:]
            target = base + module
            targets = [target] if target else [[a.name] for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "spmd_compiler"]
        for t in targets:
            if t:
                out.append((node.lineno, t[0], where.get(id(node), "module")))
    return sorted(out)


def test_every_part_has_a_place_in_the_order() -> None:
    parts = {_part(p.relative_to(ROOT).parts) for p in ROOT.rglob("*.py")} - TOP
    assert parts <= set(LEVEL), f"parts of the package missing from ORDER: {sorted(parts - set(LEVEL))}"
    assert set(LEVEL) <= parts, f"ORDER names parts the package no longer has: {sorted(set(LEVEL) - parts)}"


def test_no_part_imports_a_later_one() -> None:
    checked, violations = 0, []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).parts
        me = _part(rel)
        if me in TOP:
            continue
        for line, part, where in _imported_parts(path):
            if part == me or part not in LEVEL:
                continue
            checked += 1
            if LEVEL[part] > LEVEL[me]:
                violations.append(f"{'/'.join(rel)}:{line} ({me}) imports {part} ({where} level)")
    assert checked > 100, f"found only {checked} imports between parts; the checker no longer sees the package"
    assert not violations, "a part of the package imports a later one:\n" + "\n".join(violations)


def test_checker_sees_a_backward_import(tmp_path: pathlib.Path) -> None:
    """The checker itself: imports of other parts are found in every spelling, with
    where they are."""
    (tmp_path / "expand").mkdir()
    probe = tmp_path / "expand" / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "from ..runtime import compile\n"
        "from .. import pipeline\n"
        "import spmd_compiler.driver.io\n"
        "from spmd_compiler.dump.format import format_bytes\n"
        "from .values import x\n"
        "def f():\n"
        "    from ..testing import models\n"
        "if TYPE_CHECKING:\n"
        "    from ..optimize import run_passes\n"
    )
    assert _imported_parts(probe, tmp_path) == [
        (2, "runtime", "module"), (3, "pipeline", "module"), (4, "driver", "module"), (5, "dump", "module"),
        (6, "expand", "module"), (8, "testing", "function"), (10, "optimize", "type-checking"),
    ]
