#!/usr/bin/python3
"""A real Prometheus server (Debian's `prometheus`) scrapes `ferry store`, two `ferry serve`
and two `ferry fetch` processes through a multi-sync job, and the values it stored, read
back through its HTTP API, equal what the ranks' own reports (their JSON lines) say.

Usage: prometheus_scrape_test.py FERRY_BINARY. It fails (never skips) when the prometheus
binary is missing: scripts/install-deps.sh installs it (`make test` runs that first).
Every wait is bounded; every process it starts is stopped on the way out.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.parse
import urllib.request

FERRY = None
SOURCE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYNCS = 4
TOKEN = "prometheus-scrape-test-token-0123"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class PrometheusScrapeTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ferry-prom-")
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
            for stream in (p.stdout, p.stderr):
                if stream:
                    stream.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def start(self, args, **kw):
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        self.procs.append(p)
        return p

    def query(self, promql):
        """An instant query's result: [(labels, value)]."""
        url = "http://127.0.0.1:%d/api/v1/query?%s" % (self.prom_port, urllib.parse.urlencode({"query": promql}))
        body = json.loads(get(url))
        self.assertEqual(body["status"], "success", body)
        return [(r["metric"], float(r["value"][1])) for r in body["data"]["result"]]

    def by_rank(self, promql):
        return {(m.get("side"), int(m["rank"])): v for m, v in self.query(promql)}

    def test_prometheus_reads_what_the_ranks_report(self):
        prometheus = shutil.which("prometheus") or "/usr/bin/prometheus"
        self.assertTrue(os.access(prometheus, os.X_OK),
                        "Debian's prometheus server is not installed (scripts/install-deps.sh installs it)")
        ckpt = os.path.join(self.tmp, "ckpt")
        subprocess.run([FERRY, "checkpoint", "--model", os.path.join(SOURCE, "configs/llama-3.1-8b.json"), "--shrink",
                        "--config-overrides", '{"num_hidden_layers": 2}', "--out", ckpt], check=True,
                       stdout=subprocess.DEVNULL, timeout=120)

        # Every port Prometheus scrapes is chosen first and written into its configuration.
        store_metrics = free_port()
        ranks = [("serve", 0), ("serve", 1), ("fetch", 0), ("fetch", 1)]
        rank_ports = {r: free_port() for r in ranks}
        self.prom_port = free_port()
        targets = ", ".join("'127.0.0.1:%d'" % p for p in [store_metrics] + list(rank_ports.values()))
        config = os.path.join(self.tmp, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                    "scrape_configs:\n  - job_name: ferry\n    static_configs:\n      - targets: [%s]\n" % targets)
        prom_log = os.path.join(self.tmp, "prometheus.log")
        with open(prom_log, "w") as log:
            prom = subprocess.Popen([prometheus, "--config.file=" + config,
                                     "--storage.tsdb.path=" + os.path.join(self.tmp, "tsdb"),
                                     "--web.listen-address=127.0.0.1:%d" % self.prom_port, "--log.level=warn"],
                                    stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(prom)
        deadline = time.monotonic() + 60
        while True:
            if prom.poll() is not None:
                self.fail("prometheus exited (%d): %s" % (prom.returncode, open(prom_log).read()))
            try:
                if "Ready" in get("http://127.0.0.1:%d/-/ready" % self.prom_port, timeout=1):
                    break
            except OSError:
                pass
            self.assertLess(time.monotonic(), deadline, "prometheus not ready within 60 s")
            time.sleep(0.2)

        env = dict(os.environ, FERRY_TOKEN=TOKEN)
        store = self.start([FERRY, "store", "--port", "0", "--metrics-port", "127.0.0.1:%d" % store_metrics], env=env)
        line = store.stdout.readline()
        self.assertIn("serving tcp://", line, store.stderr.read() if not line else line)
        url = line.split("serving ")[1].split()[0]

        common = ["--store", url, "--trainer", "tp=2", "--inference", "tp=1,replicas=2", "--syncs", str(SYNCS),
                  "--job", "prom", "--metrics-linger", "60"]
        procs = {}
        for cmd, rank in ranks:
            extra = (["--checkpoint", ckpt] if cmd == "serve" else
                     ["--model", os.path.join(ckpt, "config.json"), "--verify", ckpt, "--commit", "shadow"])
            procs[(cmd, rank)] = self.start([FERRY, cmd, "--rank", str(rank), "--metrics-port",
                                             "127.0.0.1:%d" % rank_ports[(cmd, rank)]] + common + extra, env=env)
        reports = {}
        for (cmd, rank), p in procs.items():
            out, err = p.communicate(timeout=240)
            self.assertEqual(p.returncode, 0, "%s %d: %s" % (cmd, rank, err))
            lines = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
            self.assertEqual(len(lines), SYNCS, out)
            for r in lines:
                self.assertTrue(r["ok"], r)
                if cmd == "fetch":
                    self.assertTrue(r["verified"], r)
            reports[("producer" if cmd == "serve" else "consumer", rank)] = lines

        # Each rank left after a scrape had its final values; Prometheus may still be
        # appending that scrape when the test gets here: read until every rank's count is
        # in (bounded), then compare everything.
        ops = 'last_over_time(ferry_weight_update_operations_total{status="success"}[10m])'
        deadline = time.monotonic() + 30
        while self.by_rank(ops) != {who: SYNCS for who in reports} and time.monotonic() < deadline:
            time.sleep(0.5)
        self.assertEqual(self.by_rank(ops), {who: SYNCS for who in reports})

        def last(name, by="side, rank"):
            return self.by_rank("sum by (%s) (last_over_time(%s[10m]))" % (by, name))

        sums = {who: {k: sum(r[k] for r in lines) for k in ("bytes_sent", "bytes_received", "seconds")}
                for who, lines in reports.items()}
        sent, received = last("ferry_sent_bytes_total"), last("ferry_received_bytes_total")
        seconds = last("ferry_weight_update_operation_duration_seconds_sum")
        for who, s in sums.items():
            with self.subTest(rank=who):
                self.assertEqual(sent.get(who, 0), s["bytes_sent"])
                self.assertEqual(received.get(who, 0), s["bytes_received"])
                self.assertGreater(s["bytes_sent"] + s["bytes_received"], 0)
                self.assertAlmostEqual(seconds[who], s["seconds"], places=6)
        self.assertEqual(last("ferry_weight_update_operation_duration_seconds_count"), {w: SYNCS for w in reports})
        self.assertEqual(last("ferry_synced_version"), {w: SYNCS for w in reports})
        self.assertEqual(last("ferry_weight_update_in_flight"), {w: 0 for w in reports})
        consumers = {w: l for w, l in reports.items() if w[0] == "consumer"}
        self.assertEqual(last("ferry_live_version"), {w: l[-1]["live_version"] for w, l in consumers.items()})
        pause = last("ferry_commit_pause_seconds_sum")
        for w, l in consumers.items():
            self.assertAlmostEqual(pause[w], sum(r["commit_seconds"] for r in l), places=6)
        self.assertEqual(last("ferry_commit_pause_seconds_count"), {w: SYNCS for w in consumers})

        # The store: scraped while the job ran; every rank connected to it, and no proof
        # was refused (every client had the token).
        conns = self.query("max_over_time(ferry_store_connections[10m])")
        self.assertEqual(len(conns), 1, conns)
        self.assertGreaterEqual(conns[0][1], len(ranks))
        refused = self.query("last_over_time(ferry_store_refused_proofs_total[10m])")
        self.assertEqual([v for _, v in refused], [0.0])
        store.send_signal(signal.SIGTERM)
        self.assertEqual(store.wait(timeout=30), 0, store.stderr.read())


if __name__ == "__main__":
    FERRY = sys.argv.pop(1)
    unittest.main()
