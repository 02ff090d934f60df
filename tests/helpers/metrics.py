"""Scraping a /metrics page and reading its samples."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

MetricSamples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape_metrics(url: str) -> MetricSamples:
    """A /metrics page as {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct"  # the `model` label of its metrics


def metric(samples: MetricSamples, name: str, **labels: str) -> float:
    """One sample's value (0 when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
