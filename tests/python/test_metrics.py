"""ferry.Metrics from Python: the metrics of a job's ranks (threads, inproc) equal their
reports, served over HTTP, and put into an application's own prometheus_client registry."""
import threading
import unittest
import urllib.request

import ferry
from test_engine import CONFIG, NumpyTrainer, run_threads


class MetricsTest(unittest.TestCase):
    def test_metrics_of_every_rank_equal_their_reports_served_and_in_an_apps_registry(self):
        loader = ferry.ModelLoader(CONFIG, "tp=2")
        metrics = ferry.Metrics()
        with ferry.StoreServer() as server:
            trainers = [NumpyTrainer(r, 2, "tp=2") for r in range(2)]
            common = dict(token=server.token, backend="inproc", job="metrics", timeout=20.0, metrics=metrics)
            made = run_threads([lambda t=t: ferry.Producer(t, server.url, num_consumers=2, **common) for t in trainers] +
                               [lambda r=r: ferry.Consumer(loader=loader, rank=r, store=server, num_producers=2,
                                                           commit="shadow", **common) for r in range(2)])
            reports = []
            for v in (1, 2):
                for t in trainers:
                    t.version = v
                reports.append(run_threads([lambda x=x: x.sync(v) for x in made]))
            for x in made:
                x.close()
        who = [("producer", 0), ("producer", 1), ("consumer", 0), ("consumer", 1)]
        samples = {}
        for line in metrics.text().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)

        def get(name, side, rank, **labels):
            labels.update(side=side, rank=str(rank))
            key = name + "{" + ",".join('%s="%s"' % kv for kv in sorted(labels.items())) + "}"
            self.assertIn(key, samples)
            return samples[key]
        for i, (side, rank) in enumerate(who):
            self.assertEqual(get("ferry_weight_update_operations_total", side, rank, status="success"), 2)
            self.assertAlmostEqual(get("ferry_weight_update_operation_duration_seconds_sum", side, rank),
                                   sum(rep[i]["seconds"] for rep in reports), places=6)
            moved = sum(v for k, v in samples.items()
                        if k.startswith("ferry_%s_bytes_total{" % ("sent" if side == "producer" else "received"))
                        and 'side="%s"' % side in k and 'rank="%d"' % rank in k)
            self.assertEqual(moved, sum(rep[i]["bytes"] for rep in reports))
            self.assertGreater(moved, 0)
            self.assertEqual(get("ferry_synced_version", side, rank), 2)
            if side == "consumer":
                self.assertEqual(get("ferry_live_version", side, rank), 2)
                self.assertEqual(get("ferry_commit_pause_seconds_count", side, rank), 2)

        # Served over HTTP for Prometheus.
        with metrics.serve(port=0, host="127.0.0.1") as endpoint:
            self.assertGreater(endpoint.port, 0)
            got = []
            t = threading.Thread(target=lambda: got.append(urllib.request.urlopen(endpoint.url, timeout=10).read()))
            t.start()
            t.join(30)
            self.assertIn(b"ferry_weight_update_operations_total", got[0])
            self.assertEqual(endpoint.scrapes, 1)

        # Into an application's own registry, beside its own metrics.
        import prometheus_client
        registry = prometheus_client.CollectorRegistry()
        prometheus_client.Counter("app_requests", "the application's own", registry=registry).inc()
        registry.register(metrics.collector())
        self.assertEqual(registry.get_sample_value("ferry_weight_update_operations_total",
                                                   {"side": "consumer", "rank": "1", "status": "success"}), 2)
        self.assertEqual(registry.get_sample_value("app_requests_total"), 1)
        self.assertIn(b"ferry_received_bytes_total", prometheus_client.generate_latest(registry))

    def test_check_weights_names_a_param_changed_after_its_sync(self):
        loader = ferry.ModelLoader(CONFIG, "tp=1")
        with ferry.StoreServer() as server:
            trainer = NumpyTrainer(0, 1, "tp=1")
            common = dict(token=server.token, backend="inproc", job="weights", timeout=20.0, weight_digests=True)
            producer, consumer = run_threads([lambda: ferry.Producer(trainer, server.url, **common),
                                              lambda: ferry.Consumer(loader=loader, rank=0, store=server, **common)])
            for v in (1, 2):
                trainer.version = v
                run_threads([lambda: producer.sync(v), lambda: consumer.sync(v)])
                w = consumer.check_weights()
                self.assertTrue(w["ok"], w["text"])
                self.assertEqual((w["version"], w["coverage"]), (v, 1.0))
            params = consumer.params()
            name = sorted(params)[0]
            params[name].reshape(-1)[0] += 1  # the serving engine's copy, changed after the sync
            w = consumer.check_weights()
            self.assertFalse(w["ok"])
            self.assertEqual(w["changed"], [name], w["text"])
            self.assertIn(name, w["text"])
            producer.close()
            consumer.close()

    def test_metrics_keyword_takes_only_a_metrics(self):
        loader = ferry.ModelLoader(CONFIG, "tp=1")
        with self.assertRaises(ferry.InvalidArgumentError) as e:
            ferry.Consumer(loader=loader, rank=0, store="tcp://127.0.0.1:9", token="t" * 16, backend="inproc",
                           metrics="prometheus")
        self.assertIn("metrics", str(e.exception))


if __name__ == "__main__":
    unittest.main()
