"""``benchmarks/launch_cost.py``: a smoke run in the simulator (on a GPU the same run is the measurement)."""
import json


def test_every_launch_kind_is_timed(tmp_path, bench_modules):
    """Catches a launch kind the script stops timing, or a timing that is not a positive number."""
    import launch_cost
    out = tmp_path / "launch.json"
    assert launch_cost.main(["--launches", "1", "--rounds", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    names = [r["launch"] for r in rows]
    for part in ("numba kernel", "launch(), 2 arrays", "launch() with PDL, 8 arrays", "dynamic shared memory",
                 "linear()", "norm.rms_norm()"):
        assert any(part in n for n in names), (part, names)
    assert all(r["us_per_launch"] > 0 for r in rows)
