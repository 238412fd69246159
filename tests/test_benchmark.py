"""The benchmark's own arithmetic: figures are only as fair as the windows they are measured over."""

from __future__ import annotations

import pytest

from localllm.bench.engine import EngineRun
from localllm.bench.figures import Figure


def test_rate_starts_when_every_stream_has_its_first_token():
    # Stream 0 starts at t=1 and stream 1 (prefilled a step later) at t=2: the raw loop's clock starts only after
    # every prompt is prefilled, so tokens before t=2 are not counted and the window runs from 2 to the last token.
    run = EngineRun(
        tokens=[[1] * 4, [1] * 3],
        arrivals=[[(1.0, 1), (2.0, 1), (3.0, 1), (4.0, 1)], [(2.0, 1), (3.0, 1), (4.0, 1)]],
        submitted=0.5,
    )
    assert run.rate() == pytest.approx(4 / 2.0)  # t=3 and t=4 in both streams
    assert run.ttft() == pytest.approx(0.5)


def test_single_stream_rate_excludes_the_first_token_only():
    run = EngineRun(tokens=[[1] * 5], arrivals=[[(0.0, 1), (0.1, 2), (0.2, 2)]])
    assert run.rate() == pytest.approx(4 / 0.2)


def test_informational_figure_has_no_target():
    info = Figure("x", 1.0, 2.0, "tok/s", None)
    assert info.met is None and info.target_text == "—" and info.met_text == "—"
    assert Figure("y", 1.0, 2.0, "ms", 0.6, lower_is_better=True).met_text == "yes"


def test_a_shortfall_inside_the_references_own_spread_is_not_a_miss():
    close = Figure("x", 99.0, 100.0, "tok/s", 1.0, noise=0.015)
    assert close.met and "±0.015" in close.target_text
    assert not Figure("x", 97.0, 100.0, "tok/s", 1.0, noise=0.015).met
    assert not Figure("x", 99.0, 100.0, "tok/s", 1.0).met  # no second reference run: the target is exact


def test_bracketed_figure_takes_the_median_of_repeats_against_the_reference_around_ours():
    from localllm.bench.figures import Bracketed

    reference = iter([100, 102, 90, 60, 101, 99])  # a burst of load hits one reference run
    ours = iter([100, 95, 99])
    run = Bracketed.measure(lambda: next(reference), lambda: next(ours), repeats=3)
    assert run.reference == [101, 75, 100] and run.ours == [100, 95, 99]
    figure = run.figure("x", 1.0, note="n")
    assert figure.ours == 99 and figure.reference == 100  # medians: the burst does not decide the figure
    assert figure.noise == pytest.approx(0.02)  # |1 - 102/100|, |1 - 60/90|, |1 - 99/101|: the median
    assert figure.met and "median of 3 repeats" in figure.note


def test_the_bench_model_maps_the_very_file_llama_server_maps(tmp_path):
    """A copy's fresh pages made our first decodes slower than llama-server's over the original: the bench's store
    holds the weights as a hard link of the file both servers are given."""
    from tiny_models import write_tiny_llama

    from localllm.bench.rest import create_bench_model
    from localllm.models.store import Store

    weights = write_tiny_llama(tmp_path / "tiny.gguf")
    home = tmp_path / "home"
    create_bench_model(weights, home)
    (stored,) = Store(home / "models").resolve("bench").parts
    assert stored.stat().st_ino == weights.stat().st_ino
    assert not list((home / "models" / "blobs").glob(".tmp-*"))
