"""The Prometheus text exposition format, version 0.0.4, written by hand.

Pure: families in, text out. The format, in short: per family one `# HELP name text`
line, one `# TYPE name type` line, then one `name{label="value",...} number` line per
sample; the text ends with a newline. Label values escape backslash, double quote and
line feed; help text escapes backslash and line feed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Literal

import attrs

from orchestrator._metrics_histogram import HistogramSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

MetricType = Literal["counter", "gauge", "histogram", "summary", "untyped"]

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# What a histogram family's samples may append to its name.
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _check_metric_name(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not _METRIC_NAME.fullmatch(value):
        raise ValueError(f"{attribute.name} {value!r} is not a valid Prometheus metric name")


def _check_labels(
    _: object, attribute: attrs.Attribute[tuple[tuple[str, str], ...]], value: object
) -> None:
    assert isinstance(value, tuple)
    names = [name for name, _ in value]
    for name in names:
        # Names starting with "__" are reserved for Prometheus itself.
        if not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise ValueError(f"{name!r} is not a valid Prometheus label name")
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate label name in {names}")


def _labels_tuple(
    labels: Mapping[str, str] | Iterable[tuple[str, str]],
) -> tuple[tuple[str, str], ...]:
    items = labels.items() if isinstance(labels, Mapping) else labels
    return tuple((str(name), str(value)) for name, value in items)


@attrs.frozen
class MetricSample:
    """One exposition line: a metric name, its labels (in order) and its value.

    Raises `ValueError` for an invalid metric or label name, or a repeated label name.
    """

    name: str = attrs.field(validator=_check_metric_name)
    value: float
    labels: tuple[tuple[str, str], ...] = attrs.field(
        default=(), converter=_labels_tuple, validator=_check_labels
    )


def _samples_tuple(samples: Iterable[MetricSample]) -> tuple[MetricSample, ...]:
    return tuple(samples)


@attrs.frozen
class MetricFamily:
    """A `# HELP` line, a `# TYPE` line and the family's samples.

    A family may have no samples (nothing measured yet): it is still announced. Raises
    `ValueError` for an invalid name, or a sample that does not belong to the family
    (a histogram's samples are `name_bucket`, `name_sum` and `name_count`).
    """

    name: str = attrs.field(validator=_check_metric_name)
    type: MetricType
    help: str
    samples: tuple[MetricSample, ...] = attrs.field(default=(), converter=_samples_tuple)

    def __attrs_post_init__(self) -> None:
        allowed = {self.name}
        if self.type in ("histogram", "summary"):
            allowed.update(self.name + suffix for suffix in _HISTOGRAM_SUFFIXES)
        for sample in self.samples:
            if sample.name not in allowed:
                raise ValueError(f"sample {sample.name!r} does not belong to family {self.name!r}")


def escape_label_value(value: str) -> str:
    """A label value as it goes between the double quotes."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """Help text as it goes after `# HELP name `."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value: integers without a fraction, `+Inf`, `-Inf` and `NaN` spelt the
    way Prometheus parses them, other floats in their shortest round-trip form."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def format_sample(sample: MetricSample) -> str:
    """One exposition line, without its newline."""
    if not sample.labels:
        return f"{sample.name} {format_value(sample.value)}"
    labels = ",".join(f'{name}="{escape_label_value(value)}"' for name, value in sample.labels)
    return f"{sample.name}{{{labels}}} {format_value(sample.value)}"


def render_families(families: Iterable[MetricFamily]) -> str:
    """The exposition text of `families`, in order.

    Raises `ValueError` if two families share a name (Prometheus rejects such a scrape).
    """
    lines: list[str] = []
    seen: set[str] = set()
    for family in families:
        if family.name in seen:
            raise ValueError(f"metric family {family.name!r} appears twice")
        seen.add(family.name)
        lines.append(f"# HELP {family.name} {escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.type}")
        lines.extend(format_sample(sample) for sample in family.samples)
    return "\n".join(lines) + "\n" if lines else ""


# -- family builders ----------------------------------------------------------------------


def gauge(name: str, help: str, value: float | None) -> MetricFamily:
    """A gauge with one unlabelled sample, or none when `value` is `None` (unknown)."""
    samples = () if value is None else (MetricSample(name, value),)
    return MetricFamily(name, "gauge", help, samples)


def counter(name: str, help: str, value: float) -> MetricFamily:
    """A counter with one unlabelled sample; `name` should end in `_total`."""
    return MetricFamily(name, "counter", help, (MetricSample(name, value),))


def labelled(
    name: str,
    type: MetricType,
    help: str,
    label: str,
    values: Iterable[tuple[str, float]],
) -> MetricFamily:
    """A family with one sample per `(label value, value)` pair, in the given order."""
    samples = tuple(MetricSample(name, value, ((label, key),)) for key, value in values)
    return MetricFamily(name, type, help, samples)


def histogram(name: str, help: str, snapshot: HistogramSnapshot | None) -> MetricFamily:
    """A histogram family: cumulative `_bucket{le=...}` samples ending with `le="+Inf"`,
    then `_sum` and `_count`; no samples when `snapshot` is `None` (nothing measures it)."""
    if snapshot is None:
        return MetricFamily(name, "histogram", help)
    samples = [
        MetricSample(f"{name}_bucket", count, (("le", format_value(float(bound))),))
        for bound, count in zip(snapshot.bounds, snapshot.cumulative_counts, strict=True)
    ]
    samples.append(MetricSample(f"{name}_bucket", snapshot.count, (("le", "+Inf"),)))
    samples.append(MetricSample(f"{name}_sum", snapshot.sum))
    samples.append(MetricSample(f"{name}_count", snapshot.count))
    return MetricFamily(name, "histogram", help, samples)
