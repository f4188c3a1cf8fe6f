"""benchmarks/gpu.py --quick: the GPU benchmark's code paths (bare loop, adloco's rows, MFU, the table) on the CPU."""

import gpu
import pytest


@pytest.mark.training
def test_the_quick_mode_runs_every_row_and_renders_the_table():
    result = gpu.main(["--quick"])
    rows = result["rows"]
    assert list(rows) == ["bare loop", *gpu.ROWS]
    assert all(row["tokens_per_s"] > 0 for row in rows.values())
    assert rows["bare loop"]["of_bare_loop"] == 1.0 and 0 <= rows["bare loop"]["data_wait_share"] < 1
    assert all(0 < row["mfu"] < 1 for name, row in rows.items() if name != "bare loop")  # against the nominal peak
    table = gpu.render(result)
    assert table.count("\n| ") == len(rows) + 2 and "| adloco ddp, 1 rank |" in table  # with its header
    assert "No MFU on a CPU" in table and "%" not in table.split("| adloco ddp, 1 rank |")[1].split("|")[2]
