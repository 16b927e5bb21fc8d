"""Metrics against a real Prometheus: promtool on live scrapes, every dashboard query answered.

A local cluster (`starjar up`, tiny models) under load, a real Prometheus
(Debian's package; installed here if missing) scraping it through the
controller's file-SD, and every PromQL expression of every dashboard run
through Prometheus' HTTP API.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from cluster_cli import cli
from loopback import free_port, http_get
from prometheus import ensure_prometheus

from starjar import Client

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
RATE_INTERVAL = "20s"  # what Grafana would substitute for $__rate_interval at a 1 s scrape interval


@pytest.fixture(scope="module")
def observed(model_dirs, tmp_path_factory):
    """A cluster under load, scraped every second by a real Prometheus."""
    ensure_prometheus()
    tmp = tmp_path_factory.mktemp("observability")
    sd = tmp / "targets" / "starjar.json"
    env = dict(os.environ, STARJAR_HOME=str(tmp / "home"))
    up = cli("up", "--target", model_dirs["llama"], "--draft", model_dirs["draft"], "--targets", "2",
              "--gamma", "3", "--grpc-port", "0", "--http-port", "0", "--prometheus-sd", str(sd), "--json", env=env)
    assert up.returncode == 0, up.stderr[-3000:]
    addrs = json.loads(up.stdout.strip().splitlines()[-1])
    # The shipped config, with a 1 s scrape interval for a short test.
    config = (ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text()
    config = config.replace("scrape_interval: 5s", "scrape_interval: 1s").replace("refresh_interval: 30s",
                                                                                     "refresh_interval: 1s")
    (tmp / "prometheus.yml").write_text(config)
    port = free_port()
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "wb"))
    stop = threading.Event()

    def load():  # keeps both workers and the draft server busy, with a cancelled stream now and then
        with Client(addrs["grpc"], timeout=120) as c:
            i = 0
            while not stop.is_set():
                if i % 7 == 6:
                    stream = c.generate_stream(f"story {i}", max_tokens=40)
                    next(stream)
                    stream.close()
                else:
                    c.generate(f"Tell me about {i}", max_tokens=24, ignore_eos=i % 2 == 0)
                i += 1

    workers = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    [w.start() for w in workers]
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                up_targets = json.loads(http_get(f"{api}/query?query=" + urllib.parse.quote('up{job="starjar"}')))
                if sum(float(r["value"][1]) for r in up_targets["data"]["result"]) >= len(addrs["metrics"]):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("Prometheus never scraped every endpoint: " + (tmp / "prometheus.log").read_text()[-2000:])
        time.sleep(14)  # enough scrapes for 20 s rates, and two N_full samples with traffic between
        token = (sd.parent / "metrics.token").read_text().strip()  # what Prometheus sends, as the config says
        yield {"addrs": addrs, "api": api, "env": env, "sd": sd, "token": token}
    finally:
        stop.set()
        [w.join(60) for w in workers]
        prom.terminate()
        prom.wait(30)
        down = cli("down", env=env, timeout=120)
        assert down.returncode == 0


def test_promtool_accepts_a_live_scrape_of_every_component(observed):
    components = set()
    for endpoint in observed["addrs"]["metrics"]:
        text = http_get(f"http://{endpoint}/metrics", observed["token"])
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
        assert check.returncode == 0, (endpoint, check.stdout.decode() + check.stderr.decode())
        components |= {line.split('component="')[1].split('"')[0] for line in text.decode().splitlines()
                       if line.startswith("starjar_build_info")}
    assert components == {"draft_server", "target_worker", "front_end", "controller"}


def test_every_metrics_endpoint_requires_the_cluster_token(observed):
    """As every gRPC port of the cluster does: Prometheus scrapes with the token the controller wrote beside the
    SD file (the shipped config's credentials_file), and anyone without it gets 401 and nothing else."""
    token_file = observed["sd"].parent / "metrics.token"
    assert oct(token_file.stat().st_mode & 0o777) == "0o600" and len(observed["token"]) >= 32
    for endpoint in observed["addrs"]["metrics"]:
        for header in (None, "wrong-token-of-enough-length-0000"):
            with pytest.raises(urllib.error.HTTPError) as err:
                http_get(f"http://{endpoint}/metrics", header)
            assert err.value.code == 401 and b"starjar_" not in err.value.read()


def test_file_sd_lists_every_endpoint(observed):
    groups = json.loads(observed["sd"].read_text())
    listed = {t for g in groups for t in g["targets"]}
    assert listed == set(observed["addrs"]["metrics"])
    assert {g["labels"]["component"] for g in groups} == {"draft_server", "target_worker", "front_end", "controller"}


def test_promtool_accepts_the_shipped_prometheus_config(tmp_path):
    ensure_prometheus()
    # As a cluster leaves it: the token file the controller writes beside the SD file (promtool checks it exists).
    config = tmp_path / "prometheus.yml"
    config.write_text((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    (tmp_path / "targets").mkdir()
    (tmp_path / "targets" / "metrics.token").write_text("none\n")
    check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def _queries():
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                yield path.name, panel["title"], target["expr"]


def test_every_dashboard_query_returns_series(observed):
    empty = []
    for dash, title, expr in _queries():
        q = expr.replace("$__rate_interval", RATE_INTERVAL)
        body = json.loads(http_get(f"{observed['api']}/query?query=" + urllib.parse.quote(q)))
        assert body["status"] == "success", (dash, title, body)
        if not body["data"]["result"]:
            empty.append(f"{dash} / {title}: {expr}")
    assert not empty, "queries with no series:\n" + "\n".join(empty)


def test_dashboards_use_the_datasource_variable_and_rate_interval():
    assert len(DASHBOARDS) == 4
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        names = [v["name"] for v in dash["templating"]["list"] if v["type"] == "datasource"]
        assert names == ["datasource"], path.name
        for panel in dash["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}", (path.name, panel["title"])
            assert panel["description"].startswith("Metrics: starjar_"), (path.name, panel["title"])
            for t in panel["targets"]:
                assert t["datasource"]["uid"] == "${datasource}"
                assert "rate(" not in t["expr"] or "[$__rate_interval]" in t["expr"], t["expr"]


def test_committed_dashboards_match_their_generator():
    check = subprocess.run([sys.executable, str(ROOT / "deploy" / "grafana" / "build_dashboards.py"), "--check"],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_labels_stay_bounded(observed):
    """No request ids, tags, prompts or client addresses in labels: every label value is from a small set."""
    allowed = {"le", "finish_reason", "batch_bucket", "gamma", "part", "reason", "position", "target", "actor",
               "worker", "policy", "component", "version", "target_model", "draft_model", "quantile",
               "draft",  # a draft server's actor name, at most --autoscale-drafts MAX of them
               "phase"}  # the target engine's prefill / propose / verify
    for endpoint in observed["addrs"]["metrics"]:
        from prometheus_client.parser import text_string_to_metric_families

        for fam in text_string_to_metric_families(http_get(f"http://{endpoint}/metrics", observed["token"]).decode()):
            if not fam.name.startswith("starjar_"):
                continue
            for sample in fam.samples:
                assert set(sample.labels) <= allowed, (fam.name, sample.labels)


@pytest.mark.parametrize("mode", [pytest.param("fifo", marks=pytest.mark.slow), "batched"])
def test_exported_load_and_idle_agree_with_the_star_benchmark(model_dirs, models, prompt_ids, mode):
    """The star-scaling benchmark's own figures (GetStats) vs a scrape of /metrics at the end of a run."""
    from benchmarks.common import target_continuations
    from benchmarks.star import _run_n

    prompts = [p[:48] for p in prompt_ids[:4]]
    scripts = list(zip(prompts, target_continuations(models["llama"], prompts, 32), strict=True))
    # Z = 30 ms, far above 2 S on the tiny draft: the server must wait on an empty queue (T_idle > 0).
    row = _run_n(model_dirs["draft"], mode, 3, scripts, 0.03, 3.0, models["llama"].fingerprint)
    exported = row["exported"]
    assert row["draft_load"] > 0.05 and row["t_idle_ms"] > 0
    for key in ("draft_load", "t_idle_ms"):
        assert exported[key] == pytest.approx(row[key], rel=0.05), (key, exported, row)
    assert exported["draft_load_from_counters"] == pytest.approx(row["draft_load"], rel=0.05)
