"""Mutation check: seed realistic bugs into expand, optimize, driver/runtime and pipeline,
and see whether the tests that exercise that code catch them.

Each mutant replaces one exact snippet of one source file (``old``, which must occur
exactly once) with a plausible slip (``new``) and names the few fast tests that should
catch it. The repository (spmd_compiler/, tests/, pyproject.toml) is copied once into a
temporary folder; for each mutant the file is rewritten there, ``python -m pytest -x -q``
runs the mutant's tests, and the file is restored.

* caught: pytest failed (exit 1), or ran past the per-mutant timeout (a hang is a catch);
* survived: the tests passed (exit 0);
* ERROR: pytest exit 2-5 (collection or usage error, no tests ran): the mutant or its
  test list is broken, not a catch.

Before any mutant, every anchor must match exactly once (else the script stops and lists
the anchors to re-anchor after a refactor) and the union of all selected tests must pass
on the unmutated copy. Hypothesis runs with the derandomized ``ci`` profile.

Usage::

    python scripts/mutation_check.py                 # every mutant; writes benchmarks/results/mutation_check.md
    python scripts/mutation_check.py --only ID ...   # some mutants (writes nothing unless --write)
    python scripts/mutation_check.py --list          # the mutants, their files and tests

The survivors and why they survive are listed in docs/testing.md ("Mutation check").
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import pathlib
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
COPY = ["spmd_compiler", "tests", "pyproject.toml"]
RESULTS = ROOT / "benchmarks" / "results" / "mutation_check.md"


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to the repository root
    old: str  # exact snippet; must occur exactly once in ``file``
    new: str
    tests: tuple[str, ...]  # pytest node ids or files, fastest catcher first (-x stops there)
    description: str

    @property
    def module(self) -> str:
        parts = pathlib.PurePosixPath(self.file).parts
        return parts[1] if len(parts) > 2 and parts[0] == "spmd_compiler" else parts[0]


RD = "spmd_compiler/expand/redistribute.py"
CO = "spmd_compiler/expand/collectives.py"
SCHEDULE_TEST = "tests/test_optimize_schedule.py::test_schedule_keeps_training_numerics"
MLP_DP = "tests/test_expand_numerics.py::test_mlp_data_parallel"
ORDERS = "tests/test_pipeline_gloo.py::test_schedule_order_as_executed"
CONSISTENCY = "tests/test_runtime_consistency.py::test_partial_and_divergent_batches_match_one_device"
SWITCH = "tests/test_runtime_consistency.py::test_ranks_switching_to_different_cached_programs_stop_together"

MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------------ expand
    Mutant(
        "expand-allreduce-op", RD,
        "x, axis, (_reduce_op(s),), why)",
        'x, axis, ("sum",), why)',
        (MLP_DP,),
        "Partial -> Replicate all_reduce always sums: a Partial(avg) mean loss comes out n times too large",
    ),
    Mutant(
        "expand-group-axis0", CO,
        "group = b.mctx.group_names[axis]",
        "group = b.mctx.group_names[0]",
        ("tests/test_testing_simulate.py::test_unmutated_program_matches", "tests/test_expand_redistribute.py"),
        "every collective runs on mesh axis 0's process group instead of its own axis's",
    ),
    Mutant(
        "expand-gather-dim0", RD,
        "_all_gather(b, x, axis, s.dim, logical[s.dim], why), mask",
        "_all_gather(b, x, axis, 0, logical[0], why), mask",
        ("tests/test_expand_redistribute.py", "tests/test_uneven.py::test_uneven_mse"),
        "Shard(d) -> Replicate gathers along dim 0 whatever the shard dim (a data-parallel habit)",
    ),
    Mutant(
        "expand-gather-unpad", CO,
        "b.call(aten.narrow.default, g, dim, j * full, sz)",
        "b.call(aten.narrow.default, g, dim, j * sz, sz)",
        ("tests/test_properties.py::test_found_programs_match_single_device", "tests/test_uneven.py::test_uneven_mse",
         "tests/test_expand_numerics.py::test_vector_norm_of_a_shard"),
        "uneven all_gather drops the padding at each rank's own size instead of the padded chunk stride",
    ),
    Mutant(
        "expand-all-to-all-split", CO,
        "[n, shape[dst_dim] // n]",
        "[shape[dst_dim] // n, n]",
        ("tests/test_expand_numerics.py::test_mlp_fsdp_style", "tests/test_expand_redistribute.py"),
        "Shard(a) -> Shard(b) all_to_all splits the target dim element-interleaved instead of in contiguous chunks",
    ),
    Mutant(
        "expand-mask-ids-off-by-one", RD,
        "above = b.call(aten.ge.Scalar, x, end)",
        "above = b.call(aten.gt.Scalar, x, end)",
        ("tests/test_expand_redistribute.py", "tests/test_expand_numerics.py::test_transformer_tied_embeddings_dp"),
        "vocab-parallel embedding mask keeps id == end (the next rank's first row) on this rank: off by one",
    ),
    Mutant(
        "expand-norm-partial-p", RD,
        "return b.call(aten.pow.Tensor_Scalar, x, p.norm_type)",
        "return b.call(aten.pow.Tensor_Scalar, x, 2)",
        ("tests/test_expand_numerics.py::test_vector_norm_of_a_shard",),
        "a partial p-norm is reduced as if it were a 2-norm (x^2 before the sum, whatever p)",
    ),
    Mutant(
        "expand-local-chunk-floor", "spmd_compiler/expand/chunks.py",
        "return -(-size // n) if size else 0",
        "return size // n if size else 0",
        ("tests/test_uneven.py::test_uneven_mse",),
        "local chunk size with floor instead of ceil division: uneven shards lose their last rows",
    ),
    Mutant(
        "expand-arange-offset", "spmd_compiler/expand/builder.py",
        "            chunk = chunk_size(size, n)\n        start = ",
        "            chunk = size // n\n        start = ",
        ("tests/test_expand_sizes.py",),
        "arange over an unevenly sharded size starts each rank at coord * floor(total / n): off by one chunk row",
    ),
    Mutant(
        "expand-loss-local-count", "spmd_compiler/expand/rules/losses.py",
        "(loss_sum, count_all), {})",
        "(loss_sum, count), {})",
        ("tests/test_expand_losses.py::test_cross_entropy_with_ignored_targets",),
        "mean cross-entropy over a sharded target divides by the per-rank target count, not the all-reduced one",
    ),
    Mutant(
        "expand-loss-ignore-index", "spmd_compiler/expand/rules/losses.py",
        "aten.ne.Scalar, (target, ignore), {})",
        "aten.ne.Scalar, (target, -100), {})",
        ("tests/test_expand_losses.py::test_padded_language_model_data_parallel",),
        "the target count compares with the default ignore_index -100 instead of the step's",
    ),
    Mutant(
        "expand-loss-rule-all-axes", "spmd_compiler/expand/rules/losses.py",
        "any(isinstance(p, (pt.Shard, pt.StridedShard)) for p in target.spec.placements)",
        "all(isinstance(p, (pt.Shard, pt.StridedShard)) for p in target.spec.placements)",
        ("tests/test_expand_losses.py::test_padded_language_model_2d",),
        "the exact mean-loss rule only applies when the target is sharded on every mesh axis (2-D: DTensor's avg of means)",
    ),
    # ------------------------------------------------------------------ optimize
    Mutant(
        "optimize-overlap-wait-late", "spmd_compiler/optimize/overlap.py",
        "return min(users, key=lambda u: pos[u]) if users else None",
        "return max(users, key=lambda u: pos[u]) if users else None",
        ("tests/test_optimize.py::test_overlap_issues_early_and_waits_late", SCHEDULE_TEST),
        "a wait is moved to before its last use instead of its first: earlier users read the in-flight buffer",
    ),
    Mutant(
        "optimize-hoist-alias", "spmd_compiler/optimize/graph_utils.py",
        "for w in writes.get(alias_root(a), ()):\n            if pos[anchor] < pos[w] < pos[node]:",
        "for w in writes.get(a, ()):\n            if pos[anchor] < pos[w] < pos[node]:",
        ("tests/test_optimize.py::test_a_collective_is_not_hoisted_above_a_write_to_its_storage", SCHEDULE_TEST,
         "tests/test_optimize_schedule.py::test_no_write_to_a_collective_input_while_it_is_in_flight"),
        "hoisting a collective checks writes to the input node itself, not to its storage root (views missed)",
    ),
    Mutant(
        "optimize-schedule-write-in-flight", "spmd_compiler/optimize/schedule.py",
        "if ready and not busy.intersection(alias_root(x) for x in written_inputs(n)):",
        "if ready:",
        ("tests/test_optimize_schedule.py::test_no_write_to_a_collective_input_while_it_is_in_flight",),
        "an optimizer update that writes a collective's input is moved between the collective's issue and its wait",
    ),
    Mutant(
        "optimize-schedule-window", "spmd_compiler/optimize/schedule.py",
        "if start < at <= end))",
        "if start < at < end))",
        ("tests/test_optimize_schedule.py::test_no_write_to_a_collective_input_while_it_is_in_flight",),
        "the in-flight window excludes the collective waited at this very wait: off by one",
    ),
    Mutant(
        "optimize-schedule-sink-mutations", "spmd_compiler/optimize/schedule.py",
        "for p in list(n.all_input_nodes) + list(preds.get(n, ())):\n            if p in region",
        "for p in list(n.all_input_nodes):\n            if p in region",
        ("tests/test_optimize_schedule.py::test_work_a_collective_needs_through_a_write_is_not_sunk", SCHEDULE_TEST),
        "sinking independent work follows data edges only, not the order mutations impose",
    ),
    Mutant(
        "optimize-cse-ignores-writes", "spmd_compiler/optimize/redundant.py",
        "pos[prev] < pos[w] < pos[node]",
        "pos[node] < pos[w] < pos[prev]",
        ("tests/test_optimize.py::test_never_merges_reads_across_a_write_through_a_view",
         "tests/test_optimize.py::test_never_merges_values_written_in_place"),
        "CSE merges two reads of a value although an in-place write lies between them",
    ),
    Mutant(
        "optimize-fold-gather-axis", "spmd_compiler/optimize/redundant.py",
        "start.args[0] is axis_coord.get(axis)",
        "start.args[0] in axis_coord.values()",
        ("tests/test_expand_redistribute.py",),
        "gather-then-narrow folding accepts a narrow by any mesh axis's coordinate, not the gathered axis's",
    ),
    Mutant(
        "optimize-bucket-avg", "spmd_compiler/optimize/bucketing.py",
        "op = bucket[0].args[1]",
        'op = "avg"',
        (MLP_DP,),
        "fused gradient buckets are averaged, as in DDP, although the loss already is a global mean",
    ),
    Mutant(
        "optimize-bucket-split-order", "spmd_compiler/optimize/bucketing.py",
        "piece = add(operator.getitem, (parts, i))",
        "piece = add(operator.getitem, (parts, len(bucket) - 1 - i))",
        (MLP_DP,),
        "bucket copy-out hands the pieces back in reverse order",
    ),
    Mutant(
        "optimize-gathers-copy-out", "spmd_compiler/optimize/gathers.py",
        "piece = add(operator.getitem, (parts, i), meta=copy_out)",
        "piece = add(operator.getitem, (parts, len(members) - 1 - i), meta=copy_out)",
        ("tests/test_optimize_gathers.py::test_fused_gathers_keep_training_numerics",),
        "fused FSDP gather copy-out cuts the parameters out in reverse order",
    ),
    # ------------------------------------------------------------------ driver (runtime side)
    Mutant(
        "driver-fingerprint-no-sizes", "spmd_compiler/driver/agreement.py",
        'return with_sizes or (isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "_c10d_functional")',
        "return with_sizes",
        ("tests/test_runtime_agreement.py",),
        "uneven programs' fingerprints drop collective sizes too: two ranks gathering different sizes agree",
    ),
    Mutant(
        "driver-fingerprint-no-group", "spmd_compiler/driver/agreement.py",
        'return f"<group {groups[x]}>"',
        'return "<group>"',
        ("tests/test_runtime_agreement.py",),
        "fingerprints hide which mesh axis a collective's group is: collectives on different axes agree",
    ),
    Mutant(
        "driver-global-batch-even", "spmd_compiler/driver/batch.py",
        "shape[d] = sum(n for _, n in peers)",
        "shape[d] = max(n for _, n in peers) * len(peers)",
        (CONSISTENCY,),
        "the global batch size assumes every rank holds as many rows as the largest shard",
    ),
    Mutant(
        "driver-guard-min", "spmd_compiler/driver/guard.py",
        "op=dist.ReduceOp.MAX",
        "op=dist.ReduceOp.MIN",
        (CONSISTENCY,),
        "the step guard's 'my signature changed' flag is reduced with MIN: one rank's change goes unnoticed",
    ),
    Mutant(
        "driver-guard-no-resync", "spmd_compiler/driver/guard.py",
        "        if values[0] or values[1:3] != self.ids:",
        "        if values[0] > 1:",
        (CONSISTENCY,),
        "the step guard never raises Resync (flag compared with > 1)",
    ),
    Mutant(
        "driver-fold-no-resync", "spmd_compiler/driver/fold_check.py",
        "same = agreed = [r[:ids] for r in rows] == expected",
        "same = agreed = [r[:ids] for r in rows] == expected or True",
        (CONSISTENCY,),
        "the check folded into the first collective never raises Resync",
    ),
    Mutant(
        "driver-fold-join-unflagged", "spmd_compiler/driver/fold_check.py",
        "agreed = [r[:p.id_extra] for r in got] == p.expected(program) and p.digest_agrees(got) and agreed",
        "agreed = got is not None and agreed",
        (SWITCH, CONSISTENCY),
        "a rank that joins the agreed program's fold naming another program runs it without reading the others' ids",
    ),
    Mutant(
        "driver-fold-id-first-moment", "spmd_compiler/driver/fold_check.py",
        "return [program, program * program]",
        "return [program, program]",
        ("tests/test_driver_fold.py::test_check_passes_only_when_every_rank_sent_its_id", CONSISTENCY),
        "a summed fold carries the program id without its square: ids 1 and 3 read as 2 and 2",
    ),
    Mutant(
        "driver-store-state-key", "spmd_compiler/driver/io.py",
        "optimizer.state[state.params[slot.name]][slot.key] = wrap(slot, value)",
        "optimizer.state[state.params[slot.name]][slot.name] = wrap(slot, value)",
        ("tests/test_runtime_compile.py::test_decorator_and_cache", "tests/test_runtime_compile.py::test_state_becomes_dtensors"),
        "optimizer state the step created is stored under the parameter's FQN instead of its state key",
    ),
    Mutant(
        "driver-lru-fifo", "spmd_compiler/driver/step.py",
        "self._programs.move_to_end(everyone)",
        "pass",
        ("tests/test_runtime_compile.py::test_compile_cache_evicts_the_least_recently_used_program", CONSISTENCY),
        "a reused program is not marked recently used: the compile cache evicts first-in, not least recently used",
    ),
    Mutant(
        "driver-lru-evicts-newest", "spmd_compiler/driver/step.py",
        "self._programs.popitem(last=False)",
        "self._programs.popitem()",
        ("tests/test_runtime_compile.py::test_compile_cache_evicts_the_least_recently_used_program", CONSISTENCY),
        "OrderedDict.popitem() defaults to LIFO: the cache evicts the program it just compiled",
    ),
    # ------------------------------------------------------------------ runtime
    Mutant(
        "runtime-free-too-early", "spmd_compiler/runtime/executor.py",
        "last_use[a] = i",
        "last_use[a] = i - 1",
        ("tests/test_runtime_executor.py::test_runner_matches_graph_module",),
        "the executor frees each value one op before its last use",
    ),
    Mutant(
        "runtime-wrap-state-shape", "spmd_compiler/runtime/compiled.py",
        "shape, stride = slot.spec.shape, slot.spec.stride",
        "shape, stride = out.shape, out.stride()",
        ("tests/test_runtime_compile.py::test_state_becomes_dtensors",),
        "created optimizer state is wrapped as a DTensor whose global shape is the local shard's",
    ),
    Mutant(
        "runtime-wrap-state-placements", "spmd_compiler/runtime/compiled.py",
        'slot.kind == "user" and all(p.is_replicate() for p in slot.spec.placements)',
        "all(p.is_replicate() for p in slot.spec.placements)",
        ("tests/test_runtime_compile.py::test_step_counts_stay_host_scalars", "tests/test_runtime_compile.py::test_state_becomes_dtensors"),
        "replicated optimizer state is returned as a plain local tensor instead of a Replicate DTensor",
    ),
    # ------------------------------------------------------------------ pipeline
    Mutant(
        "pipeline-1f1b-cooldown-reversed", "spmd_compiler/pipeline/schedule.py",
        '        while b < m:\n            row.append(Action(r, "B", b))\n            b += 1\n        out[r] = row',
        '        row.extend(Action(r, "B", i) for i in reversed(range(b, m)))\n        out[r] = row',
        ("tests/test_pipeline_schedule.py", ORDERS),
        "1F1B cool-down runs the remaining backwards newest first",
    ),
    Mutant(
        "pipeline-1f1b-warmup", "spmd_compiler/pipeline/schedule.py",
        "warm = min(pp - 1 - r, m)",
        "warm = min(pp - r, m)",
        ("tests/test_pipeline_schedule.py",),
        "1F1B warm-up runs one forward too many on every rank",
    ),
    Mutant(
        "pipeline-loss-summed", "spmd_compiler/pipeline/step.py",
        "torch.stack(got).mean(0) if self.pipeline.scale_grads else",
        "torch.stack(got).sum(0) if self.pipeline.scale_grads else",
        (ORDERS,),
        "the micro-batch losses are summed instead of averaged",
    ),
    Mutant(
        "pipeline-scale-grads-ignored", "spmd_compiler/pipeline/runtime.py",
        "if self.scale_grads and self.m > 1:",
        "if not self.scale_grads and self.m > 1:",
        (ORDERS,),
        "scale_grads is inverted: accumulated gradients are not divided by the number of micro-batches",
    ),
    Mutant(
        "pipeline-stage-rank", "spmd_compiler/pipeline/step.py",
        "return int(mesh_ranks[tuple(c)].item())",
        "return int(mesh_ranks[tuple(coord)].item())",
        (ORDERS,),
        "stage_rank looks up this rank's own coordinate instead of the stage's: sends go to the wrong rank",
    ),
    # ------------------------------------------------------------------ randomness
    Mutant(
        "random-local-draw", "spmd_compiler/expand/rules/random.py",
        "ones = b.call(aten.ones.default, list(shape), dtype=out_val.dtype, device=out_val.device)",
        "ones = b.call(aten.ones.default, list(b.local_shape(shape, dst.placements)), dtype=out_val.dtype, device=out_val.device)",
        ("tests/test_expand_random.py::test_dropout_and_draws_equal_one_device_bit_for_bit",),
        "dropout draws each rank's local shape instead of the global one (and slices nothing off)",
    ),
    Mutant(
        "random-no-replay", "spmd_compiler/trace/rng.py",
        "            replays.append((node, live[cursor]))",
        "            live.append(node)",
        ("tests/test_trace_rng.py",),
        "activation checkpointing's recompute draws fresh random numbers instead of replaying the forward's",
    ),
    Mutant(
        "rng-no-restore", "spmd_compiler/driver/rng.py",
        "        if own is not None and dist.get_rank() != 0:",
        "        if own is not None and dist.get_rank() < 0:",
        ("tests/test_runtime_rng.py::test_per_rank_seeds_draw_from_rank0_and_keep_the_others_streams",),
        "ranks that drew from rank 0's generator keep its state instead of getting their own back",
    ),
    Mutant(
        "batchnorm-local-stats", "spmd_compiler/expand/rules/batchnorm.py",
        "        (total,), _ = replicate_axes(self.ctx, self.b, (s,), {}, axes, why)",
        "        total = s",
        ("tests/zoo/test_zoo_torch_nn.py::test_batchnorm_statistics_are_global",),
        "BatchNorm on a batch-sharded input normalizes with each rank's own statistics",
    ),
    # ------------------------------------------------------------------ issue #34: caught by the intent check
    Mutant(
        "trace-fold-through-symbols", "spmd_compiler/_private_torch/shapes.py",
        "    _no_folding_through_symbols(mode)\n    return mode",
        "    return mode",
        ("tests/test_driver_intent.py::test_nadam_state_creating_call_keeps_its_host_numbers",),
        "the fake mode folds an op on a constant tensor through a symbolic number: NAdam's mu_product on the "
        "state-creating call is tensor(nan), every parameter NaN after the first call",
    ),
    Mutant(
        "optimize-cse-merges-recompute", "spmd_compiler/optimize/redundant.py",
        "node.meta.get(FSDP_GATHER), region)",
        "node.meta.get(FSDP_GATHER))",
        ("tests/test_driver_intent.py::test_a_checkpointed_model_keeps_its_recomputation",),
        "CSE merges a checkpointed region's recomputation into the forward it repeats: same numbers, the memory "
        "checkpointing saves is gone",
    ),
    Mutant(
        "driver-checkpoint-in-place", "spmd_compiler/driver/checkpoint.py",
        'fresh = {"model": _fresh(msd), "optim": _fresh(osd)}',
        'fresh = {"model": msd, "optim": osd}',
        ("tests/test_driver_checkpoint.py",),
        "a DCP checkpoint is read straight into the live tensors: a damaged shard leaves the model half loaded",
    ),
    Mutant(
        "expand-no-write-back", "spmd_compiler/expand/dispatch.py",
        "    _write_back(b, op, args, kwargs, tensors, locals_, dst_specs)\n",
        "\n",
        ("tests/test_expand_numerics.py::test_written_arguments_redistributed_for_an_op_are_written_back",),
        "an op's in-place write into a redistributed copy of its argument is lost",
    ),
]


# ---------------------------------------------------------------------------- running
def check_anchors(mutants: list[Mutant]) -> list[str]:
    problems = []
    for m in mutants:
        path = ROOT / m.file
        if not path.exists():
            problems.append(f"{m.id}: {m.file} does not exist")
            continue
        count = path.read_text().count(m.old)
        if count != 1:
            problems.append(f"{m.id}: anchor occurs {count} times in {m.file}: {m.old!r}")
        if m.old == m.new:
            problems.append(f"{m.id}: old and new are the same")
    return problems


def union_of_tests(mutants: list[Mutant]) -> list[str]:
    """Every selected test once: a whole file absorbs its node ids."""
    tests: list[str] = []
    for m in mutants:
        for t in m.tests:
            if t not in tests:
                tests.append(t)
    files = {t for t in tests if "::" not in t}
    return [t for t in tests if "::" not in t or t.split("::")[0] not in files]


def copy_repo(dest: pathlib.Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)


def run_pytest(workdir: pathlib.Path, tests: list[str], timeout: float) -> tuple[int | None, float, str]:
    """(exit code, or None on timeout; seconds; output)."""
    env = dict(os.environ)
    env.update(PYTHONPATH=str(workdir), PYTHONDONTWRITEBYTECODE="1", HYPOTHESIS_PROFILE="ci")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, time.monotonic() - start, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # pytest and the worker processes it forked
        out, _ = proc.communicate()
        return None, time.monotonic() - start, out


def first_failure(output: str) -> str:
    for line in output.splitlines():
        m = re.match(r"(FAILED|ERROR) (\S+)", line)
        if m:
            return m.group(2)
    return ""


def verdict(rc: int | None) -> str:
    if rc is None:
        return "caught (timeout)"
    if rc == 1:
        return "caught"
    if rc == 0:
        return "survived"
    if 2 <= rc <= 5:
        return f"ERROR (pytest exit {rc})"
    return f"caught (pytest died, exit {rc})"  # killed by a signal: the mutant crashed the interpreter


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="ID", help="run only these mutants")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per mutant (a timeout counts as caught)")
    ap.add_argument("--write", action="store_true", help="write the results file even with --only")
    ap.add_argument("--verbose", action="store_true", help="print pytest's output of survivors and errors")
    args = ap.parse_args()

    mutants = MUTANTS
    ids = [m.id for m in MUTANTS]
    assert len(ids) == len(set(ids)), "duplicate mutant ids"
    if args.only:
        unknown = sorted(set(args.only) - set(ids))
        if unknown:
            ap.error(f"unknown mutant id(s) {unknown}; --list shows them")
        mutants = [m for m in MUTANTS if m.id in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.id:36} {m.file}\n    {m.description}\n    tests: {' '.join(m.tests)}")
        return 0

    problems = check_anchors(mutants)
    if problems:
        print("anchors that do not match exactly once (re-anchor them after the refactor):", file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
        return 2

    total_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spmd-mutants-") as tmp:
        work = pathlib.Path(tmp)
        copy_repo(work)
        tests = union_of_tests(mutants)
        print(f"baseline: {len(tests)} test selections on the unmutated copy ...", flush=True)
        rc, secs, out = run_pytest(work, tests, timeout=max(args.timeout, 1200.0))
        if rc != 0:
            print(out[-6000:])
            print(f"baseline failed (exit {rc}, {secs:.0f}s): fix the tests or the selection first", file=sys.stderr)
            return 2
        baseline_secs = secs
        print(f"baseline passed in {secs:.0f}s\n", flush=True)

        rows = []
        header = f"{'id':36} {'module':9} {'result':24} {'s':>5}  first failing test"
        print(header)
        print("-" * len(header))
        for m in mutants:
            path = work / m.file
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new, 1))
            try:
                rc, secs, out = run_pytest(work, list(m.tests), args.timeout)
            finally:
                path.write_text(original)
            result = verdict(rc)
            failing = first_failure(out) if rc != 0 else ""
            rows.append((m, result, secs, failing))
            print(f"{m.id:36} {m.module:9} {result:24} {secs:5.0f}  {failing}", flush=True)
            if args.verbose and not result.startswith("caught"):
                print(out[-3000:])

    caught = sum(r[1].startswith("caught") for r in rows)
    errors = [r for r in rows if r[1].startswith("ERROR")]
    survivors = [r for r in rows if r[1] == "survived"]
    total = time.monotonic() - total_start
    pct = 100.0 * caught / len(rows) if rows else 0.0
    summary = f"caught {caught} of {len(rows)} ({pct:.0f} %)"
    print(f"\n{summary}; {len(survivors)} survived, {len(errors)} errors; {total / 60:.1f} min in all (baseline {baseline_secs:.0f}s)")
    for m, *_ in survivors:
        print(f"  survived: {m.id}: {m.description}")
    for m, result, *_ in errors:
        print(f"  {result}: {m.id}: its anchor or test list is broken")

    if not args.only or args.write:
        torch_version = importlib.metadata.version("torch")
        lines = [
            "# Mutation check",
            "",
            f"`python scripts/mutation_check.py` on {platform.machine()}, {os.cpu_count()} cores, torch {torch_version}, "
            f"{datetime.date.today().isoformat()}; {total / 60:.1f} min in all (baseline run of every selected test: "
            f"{baseline_secs:.0f}s).",
            "Each mutant is one realistic slip seeded into the source; caught = its tests failed (or hung past the "
            f"{args.timeout:.0f}s timeout). Survivors and why: docs/testing.md, \"Mutation check\".",
            "",
            f"**{summary}**",
            "",
            "| id | module | result | s | first failing test | mutant |",
            "|---|---|---|---|---|---|",
        ]
        for m, result, secs, failing in rows:
            lines.append(f"| {m.id} | {m.module} | {result} | {secs:.0f} | {failing.replace('|', '/') or '-'} | {m.description} |")
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text("\n".join(lines) + "\n")
        print(f"written to {RESULTS.relative_to(ROOT)}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
