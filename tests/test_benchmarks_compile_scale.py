"""benchmarks/compile_scale.py on one layer of Llama-3 8B (on meta, compile only): the
row it measures, FSDP bytes at the analytic minimum, and its tables."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

from compile_scale import depth_table, measure, memory_table, ratios, table  # noqa: E402


@pytest.mark.parametrize("kind,dynamic", [("fsdp", False), ("2d", False), ("2d", True)])
def test_one_layer_row(kind, dynamic, monkeypatch):
    """dynamic=True: the batch dim symbolic (per-rank sizes), the same bytes (compiled
    outside explain mode, which compiles per shape, as the script does)."""
    if dynamic:
        monkeypatch.delenv("SPMD_COMPILER_EXPLAIN", raising=False)
    else:
        monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    row = measure("8B", kind, dynamic, layers=1)
    assert row["layers"] == 1 and row["nodes"] > row["traced nodes"] > 100 and row["peak"] > 0
    assert row["trace"] > 0 and row["expand"] > 0 and row["passes"] > 0 and row["total"] >= row["trace"]
    # FSDP moves the analytic minimum (and the loss and norm scalars riding along); TP
    # Megatron's 4 all_reduces per layer (the two Partial gradients of each RMSNorm's
    # input summed before one reduction: optimize/partial_sums.py)
    assert 0 <= row["axis bytes"]["dp"] - row["axis min"]["dp"] < 1024
    if kind == "2d":
        assert 0 <= row["axis bytes"]["tp"] - row["axis min"]["tp"] < 16384, row
    text = table([row])
    assert text.count("\n") == 2 and "| 8B |" in text
    if dynamic:
        return
    assert "dynamic=True / static = 1.10x" in ratios([row, {**row, "dynamic": True, "total": row["total"] * 1.1}])
    assert "growth exponent k" in depth_table([row, {**row, "layers": 2, "total": row["total"] * 2}])


def test_3d_row_is_at_the_minimum_on_dp(monkeypatch):
    """A 4-stage pipeline of four 8B layers x FSDP 8 x TP 8: stage 0 gathers its parameters
    once per step and reduce-scatters their gradients once (dp at the analytic minimum,
    which counted them once per micro-batch, 4x, before the pipeline kept its passes)."""
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    row = measure("8B", "3d", False, layers=4)
    assert row["axis bytes"]["dp"] == row["axis min"]["dp"], row
    assert 0 <= row["axis bytes"]["tp"] - row["axis min"]["tp"] < 16384, row  # Megatron's, as in 2-D
    assert "| 3d |" in table([row]) and "n/a |" in table([row])


def test_memory_policy_row(monkeypatch):
    """bf16 mixed precision with full checkpointing on one 8B layer (2-D): gathers in
    bfloat16 at the minimum that counts them so, and a lower static peak than float32."""
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    row = measure("8B", "2d", False, layers=1, memory_policy="bf16+full")
    plain = measure("8B", "2d", False, layers=1)
    assert row["policy"] == "bf16+full" and row["peak"] < plain["peak"], (row["peak"], plain["peak"])
    assert 0 <= row["axis bytes"]["dp"] - row["axis min"]["dp"] < 1024 and row["axis min"]["dp"] < plain["axis min"]["dp"]
    # tp: forward 2, recomputed 1 (bf16 activations), backward 2 in float32 (each RMSNorm's
    # input gradient reduced before its cast to bf16): 7 bf16 activations where the minimum is 5
    # (and the norms' weight gradients, a few KiB)
    assert 0 <= row["axis bytes"]["tp"] - 7 * row["axis min"]["tp"] // 5 < 65536, row
    full = measure("8B", "2d", False, layers=1, memory_policy="full")  # float32: at the minimum
    assert 0 <= full["axis bytes"]["tp"] - full["axis min"]["tp"] < 16384, full
    text = memory_table([row], [plain])
    assert "| 8B | 2d | bf16+full |" in text and text.count("\n") == 2
    with pytest.raises(ValueError, match="memory policy 'fp8'"):
        measure("8B", "2d", False, layers=1, memory_policy="fp8")


def test_float32_full_checkpointing_for_cuda_compiles(monkeypatch):
    """float32 SDPA traced for CUDA is the memory-efficient kernel, which torch tags as
    seeded for its dropout; with dropout_p=0 it draws nothing, so its checkpointed
    recompute is no draw to replay (it was refused as a recompute that 'would not get the
    forward's random numbers')."""
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    row = measure("8B", "2d", False, layers=1, memory_policy="full")
    plain = measure("8B", "2d", False, layers=1)
    assert row["policy"] == "full" and row["peak"] < plain["peak"], (row["peak"], plain["peak"])
