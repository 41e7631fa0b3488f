"""ferry.Metrics: Prometheus metrics of the syncs of every Producer and Consumer given it
(``metrics=``), served for Prometheus to scrape or put into an application's own
prometheus_client registry. docs/metrics.md lists every metric."""
from . import _ferry


class MetricsEndpoint:
    """An HTTP endpoint serving a :class:`Metrics` at ``url`` (``/metrics``) until
    ``close()`` (or the end of a ``with`` block)."""

    def __init__(self, handle):
        self._e = handle

    @property
    def port(self):
        return self._e.port

    @property
    def url(self):
        return self._e.url

    @property
    def scrapes(self):
        """How many scrapes it has answered."""
        return self._e.scrapes

    def wait_fresh_scrape(self, timeout):
        """Waits until a scrape that began after this call has every value, or ``timeout``
        seconds pass; whether one did (a short job calls it after its last sync, so that
        Prometheus, which pulls, has the final values before the process exits)."""
        return self._e.wait_fresh_scrape(float(timeout))

    def close(self):
        """Stops listening (within a couple of seconds). Idempotent."""
        if self._e is not None:
            self._e.close()
            self._e = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Metrics:
    """Counters, histograms and gauges of every sync of the ranks given it as
    ``Producer(..., metrics=m)`` / ``Consumer(..., metrics=m)`` (any number, any threads),
    each series labelled with the rank's ``side`` and ``rank``. Updated by the engine as
    the syncs run; reading them never blocks a sync."""

    def __init__(self):
        self._m = _ferry._Metrics()

    def text(self):
        """Every metric in Prometheus' text format (what a scrape returns)."""
        return self._m.text()

    def serve(self, port=0, host="0.0.0.0"):
        """Serves the metrics at ``http://host:port/metrics`` (port 0: a free one, see the
        endpoint's ``port``). IOError when it cannot listen there."""
        return MetricsEndpoint(_ferry._MetricsEndpoint.start("%s:%d" % (host, int(port)), self._m))

    def collector(self):
        """A prometheus_client collector of these metrics, for an application's own
        registry: ``prometheus_client.REGISTRY.register(m.collector())``; the application's
        own exporter then serves ferry's metrics beside its own. Needs prometheus_client
        (Debian: python3-prometheus-client)."""
        from prometheus_client.parser import text_string_to_metric_families

        metrics = self

        class _Collector:
            def collect(self):
                yield from text_string_to_metric_families(metrics.text())

        return _Collector()
