"""BulkHistogram exposes exactly what prometheus-client's own Histogram would for the same values."""

from prometheus_client import CollectorRegistry, Histogram

from kvserve.server.bulk_histogram import BulkHistogram, BulkHistogramCollector

BUCKETS = [0.01, 0.1, 1.0, 10.0]
VALUES = [0.0, 0.01, 0.010001, 0.5, 1.0, 1.0, 3.0, 10.0, 11.0, 1e9]  # on, just past and between the bounds


def samples(registry: CollectorRegistry) -> list[tuple[str, list, float]]:
    """Every sample but `_created` (a timestamp, and switched off by server.metrics)."""
    return sorted(
        (s.name, sorted(s.labels.items()), s.value)
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    )


def test_bulk_histogram_matches_prometheus_clients_histogram():
    reference = CollectorRegistry()
    histogram = Histogram("x_seconds", "doc", ["model_name"], registry=reference, buckets=BUCKETS).labels("m")
    for value in VALUES:
        histogram.observe(value)

    bulk_registry = CollectorRegistry()
    bulk = BulkHistogram("x_seconds", "doc", BUCKETS)
    bulk_registry.register(BulkHistogramCollector([bulk], {"model_name": "m"}))
    bulk.observe_all(VALUES[:3])
    bulk.observe_all(iter(VALUES[3:]))  # any iterable, several calls add up

    assert samples(bulk_registry) == samples(reference)
    assert bulk_registry.get_sample_value("x_seconds_bucket", {"model_name": "m", "le": "1.0"}) == 6
