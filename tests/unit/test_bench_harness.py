"""The benchmark harness's own logic: row selection, streamed-result checks, verdict lines.

Nothing here runs a benchmark (no timing, no peer library): these are the parts that decide
what is measured, what counts as a wrong result and which rows a target compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_libs  # noqa: E402
import bench_workloads as wl  # noqa: E402
import run  # noqa: E402

from easycore import WorkerError  # noqa: E402

CASES = run.build_cases(quick=False, workers=2, mode="call")


def groups_and_roles(only: str) -> set[tuple[str, str]]:
    return {(c.group, c.role) for c in run.select(CASES, only)}


class TestSelect:
    def test_a_group_name_selects_that_group_alone(self):
        assert {g for g, _ in groups_and_roles("W3")} == {"W3"}
        assert {g for g, _ in groups_and_roles("W4 warm")} == {"W4 warm"}

    def test_a_workload_that_names_no_group_selects_all_its_groups(self):
        assert {g for g, _ in groups_and_roles("W4")} == {"W4 cold", "W4 warm"}

    def test_a_streamed_group_brings_only_the_copy_reference_of_its_workload(self):
        picked = groups_and_roles("w3b stream")
        assert ("W3b", "reference") in picked
        assert {g for g, r in picked if r != "reference"} == {"W3b stream"}

    def test_unknown_names_exit(self):
        with pytest.raises(SystemExit):
            run.select(CASES, "W99")


def arrays(n: int) -> list[np.ndarray]:
    return [wl.make_array(i) for i in range(n)]


class TestStreamedFold:
    def fold(self, fold, results):
        acc = wl.FOLD_INIT
        for r in results:
            acc = fold(acc, r)
        return acc

    def test_in_order_results_pass(self):
        wl.check_folded(self.fold(wl.fold_array, arrays(5)), 5)
        tensors = [wl.make_tensor(i) for i in range(3)]
        wl.check_folded(self.fold(wl.fold_tensor, tensors), 3)

    def test_out_of_order_results_fail(self):
        xs = arrays(3)
        with pytest.raises(wl.WrongResult, match="expected all 1"):
            self.fold(wl.fold_array, [xs[0], xs[2], xs[1]])

    def test_a_missing_or_doubled_result_fails(self):
        with pytest.raises(wl.WrongResult):
            wl.check_folded(self.fold(wl.fold_array, arrays(4)), 5)
        xs = arrays(2)
        with pytest.raises(wl.WrongResult):
            self.fold(wl.fold_array, [xs[0], xs[1], xs[1]])

    def test_one_stale_page_fails(self):
        xs = arrays(3)
        xs[2][wl.W3_ELEMENTS // 2 + 5 * 1024] = 7.0  # one element on one page, mid-array
        with pytest.raises(wl.WrongResult, match=r"from 2\.0 to 7\.0"):
            self.fold(wl.fold_array, xs)

    def test_wrong_type_dtype_or_shape_fails(self):
        with pytest.raises(wl.WrongResult, match="expected a numpy array"):
            wl.fold_array(wl.FOLD_INIT, wl.make_tensor(0))
        with pytest.raises(wl.WrongResult, match=r"expected a torch\.Tensor"):
            wl.fold_tensor(wl.FOLD_INIT, wl.make_array(0))
        with pytest.raises(wl.WrongResult, match="dtype"):
            wl.fold_array(wl.FOLD_INIT, np.zeros(wl.W3_ELEMENTS, dtype=np.float64))
        with pytest.raises(wl.WrongResult, match="shape"):
            wl.fold_tensor(wl.FOLD_INIT, torch.zeros(8, dtype=torch.float32))


class TestChildExit:
    def test_a_wrong_result_wrapped_by_a_library_is_still_wrong(self, monkeypatch):
        def measure(*args):
            try:
                wl.fold_array(wl.FOLD_INIT, wl.make_array(3))  # result 0 must be all 0
            except wl.WrongResult as exc:
                raise WorkerError("consumer raised") from exc

        monkeypatch.setattr(bench_libs, "measure", measure)
        assert run.child("easycore", "W3b", "stream=1", 1, 2, "call") == run.EXIT_WRONG

    def test_any_other_failure_is_exit_1(self, monkeypatch):
        def measure(*args):
            raise RuntimeError("broken")

        monkeypatch.setattr(bench_libs, "measure", measure)
        assert run.child("easycore", "W3b", "stream=1", 1, 2, "call") == 1


def row(group: str, lib: str, variant: str, role: str, seconds: float) -> run.Row:
    r = run.Row(run.Case(group, lib, variant, role, f"{lib} {variant}"), n=200)
    r.seconds = [seconds]
    return r


def verdict(rows: list[run.Row]) -> dict[tuple[str, str], float | None]:
    for gname in {r.case.group for r in rows}:
        run.finish_group(run.GROUPS[gname], [r for r in rows if r.case.group == gname])
    return {(t.group, t.what): t.value for t in run.targets(rows)}


class TestTargets:
    def test_streamed_groups_use_the_keep_all_copy_reference(self):
        got = verdict(
            [
                row("W3b", "reference", "what=copy", "reference", 0.4),
                row("W3b stream", "futures", "stream=1", "peer", 2.0),
                row("W3b stream", "easycore", "stream=1", "easycore", 0.2),
            ]
        )
        assert got[("W3b stream", "easycore / best peer, GB/s")] == pytest.approx(10.0)
        assert got[("W3b stream", "easycore / in-process copy, GB/s")] == pytest.approx(2.0)
        assert not any(g == "W3b" for g, _ in got)  # the reference alone makes no target line

    def test_w4_cold_bound_needs_the_torch_caller_row(self):
        rows = [
            row("W4 cold", "reference", "what=import-torch", "reference", 1.0),
            row("W4 cold", "pool", "context=fork,phase=cold", "peer", 0.01),
            row("W4 cold", "easycore", "phase=cold", "easycore", 0.2),
        ]
        got = verdict(rows)
        assert got[("W4 cold", "easycore (torch caller) - `import torch` (s)")] is None
        rows.append(row("W4 cold", "easycore", "phase=cold,caller=torch", "easycore", 1.3))
        got = verdict(rows)
        assert got[("W4 cold", "easycore (torch caller) - `import torch` (s)")] == pytest.approx(
            0.3
        )

    def test_the_context_row_is_never_the_best_peer(self):
        got = verdict(
            [
                row("W4 warm", "pool", "context=fork,phase=warm", "peer", 0.008),
                row("W4 warm", "pool", "context=fork,phase=warm,caller=torch", "context", 0.001),
                row("W4 warm", "easycore", "phase=warm", "easycore", 0.012),
                row("W4 warm", "easycore", "phase=warm,caller=torch", "easycore", 0.024),
            ]
        )
        assert got[("W4 warm", "easycore (no torch) time / fastest fork peer")] == pytest.approx(
            1.5
        )
        both = got[("W4 warm", "easycore / Pool fork, both callers with torch")]
        assert both == pytest.approx(24.0)


def _row(group: str, lib: str, variant: str, role: str, seconds, extra=None) -> run.Row:
    case = next(c for c in CASES if (c.group, c.lib, c.variant) == (group, lib, variant))
    row = run.Row(case, 100, seconds=list(seconds), extra=list(extra or [{}] * len(seconds)))
    assert case.role == role
    return row


class TestTrainingAndLedgerRows:
    def test_w6_selects_its_three_cases(self):
        assert {g for g, _ in groups_and_roles("W6")} == {"W6 fast", "W6 slow", "W6 pause"}

    def test_w6_figure_is_the_epoch_against_its_ideal(self):
        """Lower is better: 3 s for an ideal of 2 s is 1.5x; DataLoader is the peer."""
        ideal = {"ideal": 2.0, "wait": 0.3, "after_pause": 0.0}
        ec = _row("W6 fast", "easycore", "case=fast", "easycore", [3.0, 2.2, 2.4], [ideal] * 3)
        dl = _row("W6 fast", "dataloader", "case=fast", "peer", [2.6, 2.6, 2.6], [ideal] * 3)
        group = run.GROUPS["W6 fast"]
        run.finish_group(group, [ec, dl])
        assert ec.values == [1.5, 1.1, 1.2]
        assert run.best_peer(group, [ec, dl]) is dl
        assert run.ratio(group, ec, dl) == pytest.approx(1.3 / 1.2)

    def test_the_ledger_target_compares_the_same_work(self):
        """W5's ledger row is compared with the pools row, not the fused one."""
        rows = [
            _row("W5", "easycore", "pools=2+1", "easycore", [1.0]),
            _row("W5", "easycore", "pools=2+1,resume=1", "easycore", [1.0]),
            _row("W5", "easycore", "procs=3", "peer", [1.0]),
        ]
        for r, v in zip(rows, [5000.0, 4600.0, 2000.0], strict=True):
            r.values = [v]
        (target,) = run._ledger_targets("W5", [r for r in rows if r.case.role == "easycore"])
        assert target.value == pytest.approx(0.92)
        assert target.passed


class TestRayRows:
    def test_the_ray_groups_compare_easycore_on_ray_with_ray_data(self):
        """The target is easycore's Ray engine against the best Ray Data row; the local
        engine's row is shown beside them and is not a peer."""
        rows = [
            _row("W5 ray", "raydata", "default", "peer", [2.0]),
            _row("W5 ray", "raydata", "batch_size=64", "peer", [1.5]),
            _row("W5 ray", "easycore", "engine=ray", "easycore", [1.0]),
            _row("W5 ray", "easycore", "pools=1+1", "local", [0.5]),
        ]
        run.finish_group(run.GROUPS["W5 ray"], rows)
        assert run.best_peer(run.GROUPS["W5 ray"], rows) is rows[1]
        got = {(t.group, t.what): t for t in run.targets(rows)}
        target = got[("W5 ray", "easycore on Ray / best Ray Data, items/s")]
        assert target.value == pytest.approx(1.5) and target.passed


class TestWriteRows:
    def test_w7_is_the_resume_group_and_w7_write_its_own(self):
        assert {g for g, _ in groups_and_roles("W7")} == {"W7"}
        assert {g for g, _ in groups_and_roles("W7 write")} == {"W7 write"}

    def test_the_write_targets_compare_easycore_rows_with_their_own_references(self):
        """Ray Data's rows and HF datasets' share the write row's variant: the write target
        is easycore's write row against the best Ray Data row (not HF's), and the overhead
        target its time against easycore's compute-only row."""
        rows = [
            _row("W7 write", "easycore", "write=parquet", "easycore", [2.3]),
            _row("W7 write", "easycore", "write=none", "baseline", [2.0]),
            _row("W7 write", "easycore", "write=parquet,resume=1", "context", [2.5]),
            _row("W7 write", "raydata", "write=parquet", "peer", [4.6]),
            _row("W7 write", "raydata", "write=parquet,batch_size=1000", "peer", [6.0]),
            _row("W7 write", "datasets", "write=parquet", "peer", [1.0]),
        ]
        run.finish_group(run.GROUPS["W7 write"], rows)
        got = {(t.group, t.what): t for t in run.targets(rows)}
        vs_ray = got[("W7 write", "easycore write / best Ray Data, items/s")]
        assert vs_ray.value == pytest.approx(2.0) and vs_ray.passed
        cost = got[("W7 write", "easycore write time / compute-only time")]
        assert cost.value == pytest.approx(1.15) and cost.passed


class TestSpdlAndTorchdataRows:
    def test_w10_selects_its_two_sizes_each_with_every_candidate(self):
        picked = run.select(CASES, "W10")
        assert {c.group for c in picked} == {"W10 1k", "W10 4k"}
        for g in ("W10 1k", "W10 4k"):
            libs = {c.lib for c in picked if c.group == g}
            assert libs == {"sequential", "dataloader", "spdl", "easycore"}

    def test_the_w5_target_compares_pools_with_the_fused_runs_only(self):
        """SPDL's and torchdata's rows run two stages too: the best peer of the table, but
        the pools target stays against the best fused run."""
        rows = [
            _row("W5", "easycore", "pools=2+1", "easycore", [1.0]),
            _row("W5", "easycore", "procs=3", "peer", [2.0]),
            _row("W5", "spdl", "stages=1", "peer", [0.5]),
        ]
        run.finish_group(run.GROUPS["W5"], rows)
        assert run.best_peer(run.GROUPS["W5"], rows) is rows[2]
        got = {(t.group, t.what): t.value for t in run.targets(rows)}
        assert got[("W5", "pools / best fused run, items/s")] == pytest.approx(2.0)
