"""A daemon's Prometheus endpoint: a daemon started serving one on a port of its choosing,
and its samples scraped into a dict."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape_metrics(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from GET /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def daemon_with_metrics(daemon_factory, tmp_path, *extra: str):
    """A daemon from conftest's daemon_factory (`extra` flags) serving metrics; returns (the
    daemon, the metrics port)."""
    port_file = tmp_path / "metrics.port"
    config = tmp_path / "metrics.toml"
    config.write_text(f'[metrics]\nlisten = "127.0.0.1:0"\nport_file = "{port_file}"\n')
    daemon = daemon_factory(*extra, config=config)
    return daemon, int(port_file.read_text())
