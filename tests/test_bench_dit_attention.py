"""Tests of scripts/bench_dit_attention.py's arguments and its sweep's report (the timings need a GPU)."""

import argparse
from pathlib import Path

import pytest

from conftest import load_module


bench = load_module(Path(__file__).resolve().parents[1] / "scripts" / "bench_dit_attention.py", "bench_dit_attention")


def test_tiles_narrow_the_sweep_grid_and_bad_ones_are_refused():
    assert bench.tile_grid(None) == bench.TILES
    grid = bench.tile_grid('{"block_m": [32, 128], "num_stages": [3]}')
    assert grid["block_m"] == (32, 128) and grid["num_stages"] == (3,)
    assert grid["block_n"] == bench.TILES["block_n"] and grid["num_warps"] == bench.TILES["num_warps"]
    for text, message in (
        ("[1]", "JSON object"),
        ("{", "not JSON"),
        ('{"block_k": [32]}', "no option 'block_k'"),
        ('{"block_m": []}', "non-empty list"),
        ('{"block_m": [0]}', "positive integers"),
        ('{"block_m": 64}', "non-empty list"),
        ('{"block_m": [true]}', "positive integers"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            bench.tile_grid(text)


def test_sweep_reports_the_default_tiles_time():
    """The sweep's summary named the default tiles' time as None whatever it measured (it looked the tiles up in a
    dict keyed by the times)."""
    default = (64, 64, 4, 2)
    results = [(9.5, (32, 64, 4, 2)), (15.2, default), (12.0, (128, 64, 8, 3))]
    assert bench.default_tiles_time(results, default) == 15.2
    assert bench.default_tiles_time(results, [128, 64, 8, 3]) == 12.0
    assert bench.default_tiles_time([(9.5, (32, 64, 4, 2))], default) is None


def test_arguments_are_checked_before_any_gpu_work(capsys):
    for argv, message in (
        (["--tiles", '{"block_m": [32]}'], "pass both"),
        (["--sweep", "--streams", "0"], "at least 1"),
        (["--sweep", "--tiles", '{"warps": [4]}'], "no option 'warps'"),
    ):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert message in capsys.readouterr().err
