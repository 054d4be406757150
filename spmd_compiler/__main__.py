"""Command line: ``python -m spmd_compiler explain SCRIPT`` and ``... diff DIR_A DIR_B``.

explain
    Runs a training script with its process group replaced by a fake one of
    ``--world-size`` ranks (this process is rank 0, nothing is communicated) and its
    compiled steps compiled and dumped but never executed (they return zeros). Then
    prints, for every program compiled: why, the collectives per rank per step with
    their reasons and bytes, the static memory peak per rank, and its report.
diff
    Compares the collectives of two dump folders (two plans, or before/after a pass).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import runpy
import sys


def _explain(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    dump = pathlib.Path(args.dump_dir).resolve()
    os.environ["SPMD_COMPILER_EXPLAIN"] = "1"
    os.environ["SPMD_COMPILER_DUMP"] = str(dump)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(args.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29599")
    real_init = dist.init_process_group

    def fake_init(*a, **k):  # whatever backend the script asks for
        if not dist.is_initialized():
            real_init("fake", rank=0, world_size=args.world_size)

    dist.init_process_group = fake_init
    real_exit = os._exit
    os._exit = _exit_as_exception  # a script that leaves with os._exit() still gets its summary
    before = set(dump.glob("*")) if dump.exists() else set()
    sys.argv = [args.script, *args.script_args]
    code = 0
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    except Exception as e:  # the script failed: still show what was compiled
        import traceback

        traceback.print_exc()
        print(f"explain: {args.script} raised {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    finally:
        dist.init_process_group = real_init
        os._exit = real_exit
    written = sorted(p for p in set(dump.glob("*")) - before if (p / "meta.json").exists()) if dump.exists() else []
    if not written:
        print(f"explain: {args.script} compiled nothing (no spmd_compiler.compile step was called)", file=sys.stderr)
        return 1
    from .dump.overview import explain_overview

    sys.stdout.flush()
    print("\n" + explain_overview(written, script=args.script, world_size=args.world_size), flush=True)
    return 0 if code in (0, None) else int(code)


def _exit_as_exception(code: int = 0) -> None:
    """``os._exit`` while explain runs a script: nothing to tear down on a fake process
    group, so leave the script as ``sys.exit`` would and let explain print its summary."""
    raise SystemExit(code)


def _diff(args: argparse.Namespace) -> int:
    from .dump.diff import diff_dumps

    result = diff_dumps(args.a, args.b)
    print(result.text())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spmd_compiler", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="compile a training script on a fake process group and dump it")
    ex.add_argument("script")
    ex.add_argument("--world-size", type=int, default=4)
    ex.add_argument("--dump-dir", default="spmd_dump")
    ex.epilog = "Arguments after -- go to the script: explain train.py --world-size 8 -- --strategy 2d"
    df = sub.add_parser("diff", help="compare the collectives of two dump folders")
    df.add_argument("a")
    df.add_argument("b")
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if args.command == "explain":
        args.script_args = script_args
        return _explain(args)
    return _diff(args)


if __name__ == "__main__":
    sys.exit(main())
