"""The exposition-format writer and the histogram, on their own."""

from __future__ import annotations

import math

import pytest

from orchestrator._metrics_format import (
    escape_help,
    format_value,
    gauge,
    histogram,
    labelled,
)
from orchestrator.metrics import (
    Histogram,
    MetricFamily,
    MetricSample,
    escape_label_value,
    render_families,
)


@pytest.mark.parametrize(
    ("raw", "escaped"),
    [
        ("plain", "plain"),
        ('a "quoted" word', 'a \\"quoted\\" word'),
        ("back\\slash", "back\\\\slash"),
        ("two\nlines", "two\\nlines"),
        ('\\"\n', '\\\\\\"\\n'),
        ("tab\tand ünïcode", "tab\tand ünïcode"),  # only \\, " and \n are escaped
    ],
)
def test_label_values_escape_backslash_quote_and_newline(raw: str, escaped: str) -> None:
    assert escape_label_value(raw) == escaped


def test_help_escapes_backslash_and_newline_but_not_quotes() -> None:
    assert escape_help('say "a\\b"\nok') == 'say "a\\\\b"\\nok'


@pytest.mark.parametrize(
    ("number", "text"),
    [
        (0, "0"),
        (12_000_000_000, "12000000000"),
        (0.25, "0.25"),
        (1.0, "1.0"),
        (1e-7, "1e-07"),
        (math.inf, "+Inf"),
        (-math.inf, "-Inf"),
        (math.nan, "NaN"),
    ],
)
def test_values_are_spelt_the_way_prometheus_reads_them(number: float, text: str) -> None:
    assert format_value(number) == text
    if not math.isnan(number):
        assert float(text.replace("Inf", "inf")) == number


def test_a_family_renders_help_type_and_samples_in_order() -> None:
    family = labelled("jobs_total", "counter", "Jobs\ndone.", "state", [("ok", 3), ("bad", 1)])
    assert render_families([family, gauge("depth", "Queue depth.", 2.5)]) == (
        "# HELP jobs_total Jobs\\ndone.\n"
        "# TYPE jobs_total counter\n"
        'jobs_total{state="ok"} 3\n'
        'jobs_total{state="bad"} 1\n'
        "# HELP depth Queue depth.\n"
        "# TYPE depth gauge\n"
        "depth 2.5\n"
    )


def test_several_labels_keep_their_order() -> None:
    sample = MetricSample("x", 1, {"b": "2", "a": "1"})
    family = MetricFamily("x", "gauge", "X.", [sample])
    assert render_families([family]).endswith('x{b="2",a="1"} 1\n')


def test_an_unknown_gauge_has_no_sample() -> None:
    assert render_families([gauge("bound", "Bound.", None)]) == (
        "# HELP bound Bound.\n# TYPE bound gauge\n"
    )


def test_nothing_renders_as_empty_text() -> None:
    assert render_families([]) == ""


@pytest.mark.parametrize("name", ["", "1abc", "has space", "dash-ed", "brace{"])
def test_invalid_metric_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="not a valid Prometheus metric name"):
        gauge(name, "help", 1)


@pytest.mark.parametrize("label", ["", "1a", "a:b", "__reserved", "a-b"])
def test_invalid_label_names_are_refused(label: str) -> None:
    with pytest.raises(ValueError, match="not a valid Prometheus label name"):
        MetricSample("x", 1, ((label, "v"),))


def test_repeated_label_names_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicate label name"):
        MetricSample("x", 1, (("a", "1"), ("a", "2")))


def test_a_sample_must_belong_to_its_family() -> None:
    with pytest.raises(ValueError, match="does not belong"):
        MetricFamily("x", "gauge", "X.", [MetricSample("y", 1)])
    with pytest.raises(ValueError, match="does not belong"):
        MetricFamily("x", "gauge", "X.", [MetricSample("x_bucket", 1)])
    # ...while a histogram's own suffixes are fine.
    MetricFamily("x", "histogram", "X.", [MetricSample("x_sum", 1), MetricSample("x_count", 1)])


def test_two_families_with_one_name_are_refused() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        render_families([gauge("x", "X.", 1), gauge("x", "X again.", 2)])


# -- histograms -----------------------------------------------------------------------------


def test_histogram_buckets_are_inclusive_upper_bounds() -> None:
    recorder = Histogram((0.1, 1.0, 10.0))
    for seconds in (0.05, 0.1, 0.5, 1.0, 99.0):
        recorder.observe(seconds)
    snapshot = recorder.snapshot()
    assert snapshot.bounds == (0.1, 1.0, 10.0)
    assert snapshot.cumulative_counts == (2, 4, 4)
    assert snapshot.count == 5
    assert snapshot.sum == pytest.approx(100.65)


def test_a_histogram_renders_buckets_then_sum_and_count() -> None:
    recorder = Histogram((1, 2))
    recorder.observe(1.5)
    recorder.observe(3.0)
    assert render_families([histogram("h", "H.", recorder.snapshot())]) == (
        "# HELP h H.\n"
        "# TYPE h histogram\n"
        'h_bucket{le="1.0"} 0\n'
        'h_bucket{le="2.0"} 1\n'
        'h_bucket{le="+Inf"} 2\n'
        "h_sum 4.5\n"
        "h_count 2\n"
    )


def test_nan_is_counted_in_the_inf_bucket_only() -> None:
    recorder = Histogram((1.0,))
    recorder.observe(math.nan)
    snapshot = recorder.snapshot()
    assert snapshot.cumulative_counts == (0,)
    assert snapshot.count == 1


def test_a_snapshot_does_not_change_afterwards() -> None:
    recorder = Histogram((1.0,))
    before = recorder.snapshot()
    recorder.observe(0.5)
    assert before.count == 0
    assert before.cumulative_counts == (0,)


@pytest.mark.parametrize(
    ("bounds", "problem"),
    [((), "at least one"), ((1.0, 1.0), "strictly increasing"), ((2.0, 1.0), "strictly"),
     ((1.0, math.inf), "finite"), ((math.nan,), "finite")],
)  # fmt: skip
def test_bad_bucket_bounds_are_refused(bounds: tuple[float, ...], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        Histogram(bounds)
