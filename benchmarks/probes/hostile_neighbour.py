"""What a hostile neighbour and a hostile client cost a running `starjar up` (tiny models, this machine).

    python benchmarks/probes/hostile_neighbour.py [--checkout DIR] [--out FILE]

--checkout runs the cluster from another checkout of starjar (an older commit, for a before/after on one
machine); the probe's own client code is this checkout's. Five attacks, one after another, while real
clients generate through the front end:

- ray: a process without the cluster's Ray token tries to join and call the controller;
- hog: two attached streams of 256 sequences x 511 tokens, resent from position 0 every round, for --hog-s
  seconds: the real targets' steps without drafts (draft_fallbacks_total) before and during, and the draft
  server's RSS during, after the streams end and after --settle-s more;
- flood: 24 concurrent 3.7 MB JSON bodies to the OpenAI port while a stream runs: its largest gap between
  chunks, against the same stream alone;
- sockets: 2,000 idle connections to a target's metrics port: that process's threads and open files, and
  whether a scrape is still answered.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.fixtures.tiny_models import make_tiny_model  # noqa: E402
from benchmarks.meta import git_state, result_meta  # noqa: E402
from starjar.client import Client  # noqa: E402
from starjar.service.security import Security  # noqa: E402
from starjar.v1 import draft_pb2 as pb  # noqa: E402
from starjar.v1 import draft_pb2_grpc as pb_grpc  # noqa: E402

PROMPT_LEN, CLIENTS, MAX_TOKENS = 24, 4, 48


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Cluster:
    """`starjar up` from `checkout`, in a STARJAR_HOME of its own; `down` at close."""

    def __init__(self, checkout: Path, models: dict, home: Path, token: str):
        self.checkout, self.home = checkout, home
        token_file = home / "cluster.token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        self.token = token
        self.env = {**os.environ, "STARJAR_HOME": str(home), "PYTHONPATH": str(checkout)}
        for k in [k for k in self.env if k.startswith("RAY_")]:
            del self.env[k]
        cmd = [sys.executable, "-m", "controller.cli.main", "up", "--json", "--target", models["target"], "--draft",
               models["draft"], "--targets", "2", "--gamma", "3", "--grpc-port", "0", "--http-port", "0",
               "--auth-token-file", str(token_file)]
        _say("starting the cluster from " + str(checkout))
        out = subprocess.run(cmd, cwd=checkout, env=self.env, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise SystemExit("starjar up failed:\n" + out.stderr[-3000:])
        self.addrs = json.loads(out.stdout.strip().splitlines()[-1])
        self.state = json.loads((home / "run" / "cluster.json").read_text())

    def close(self) -> None:
        subprocess.run([sys.executable, "-m", "controller.cli.main", "down"], cwd=self.checkout, env=self.env,
                       capture_output=True, timeout=300)

    def ray_env(self) -> dict:
        """The environment of a process that holds the cluster's Ray token (or of any, where Ray has no auth)."""
        env = _no_ray_auth()
        token = self.home / "run" / "ray_auth_token"
        if token.exists():
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
        return env

    def status(self) -> dict:
        code = (f"import json, ray; ray.init(address={self.state['ray_address']!r}, namespace='starjar', "
                "log_to_driver=False); print(json.dumps(ray.get(ray.get_actor('starjar-controller').status.remote(), "
                "timeout=60)))")
        out = subprocess.run([sys.executable, "-c", code], env=self.ray_env(), capture_output=True, text=True,
                             timeout=180)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def scrape(self, address: str) -> str:
        host, port = address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {self.token}"})
        body = conn.getresponse().read().decode()
        conn.close()
        return body


def _no_ray_auth() -> dict:
    """This environment without Ray's auth settings, with the ones a single-host driver needs to reach a
    loopback cluster (else it looks for the GCS at the machine's own address)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def _models(root: Path) -> dict:
    target = make_tiny_model(root / "target", "llama", seed=0)
    draft = make_tiny_model(root / "draft", "llama", seed=0, layers=1, tokenizer_from=target)
    return {"target": str(target), "draft": str(draft)}


def _sum_metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def _target_counts(cluster: Cluster) -> dict:
    """Decode steps and steps without drafts, summed over the target workers' metrics endpoints."""
    steps = fallbacks = 0.0
    for address in cluster.addrs["metrics"]:
        text = cluster.scrape(address)
        if "starjar_target_decode_steps" in text:
            steps += _sum_metric(text, "starjar_target_decode_steps_total")
            fallbacks += _sum_metric(text, "starjar_target_draft_fallbacks_total")
    return {"decode_steps": steps, "fallback_steps": fallbacks}


class Load:
    """CLIENTS threads generating greedily through the front end until stopped; errors counted."""

    def __init__(self, grpc_address: str):
        self.stop, self.done, self.errors = threading.Event(), 0, 0
        self.threads = [threading.Thread(target=self._run, args=(grpc_address, k), daemon=True)
                        for k in range(CLIENTS)]
        [t.start() for t in self.threads]

    def _run(self, address: str, k: int) -> None:
        with Client(address, timeout=120) as client:
            i = 0
            while not self.stop.is_set():
                ids = [5 + (k * 31 + i * 7 + j) % 300 for j in range(PROMPT_LEN)]
                try:
                    client.generate(prompt_token_ids=ids, max_tokens=MAX_TOKENS, temperature=0.0)
                    self.done += 1
                except Exception:  # counted: the probe reports failures, it does not stop on them
                    self.errors += 1
                i += 1

    def close(self) -> None:
        self.stop.set()
        [t.join(timeout=180) for t in self.threads]


def _window(cluster: Cluster, seconds: float) -> dict:
    before = _target_counts(cluster)
    time.sleep(seconds)
    after = _target_counts(cluster)
    return {k: after[k] - before[k] for k in before}


def probe_ray(cluster: Cluster) -> dict:
    """A process with Ray's auth turned off, and none with token mode and no token, tries to join."""
    code = (f"import ray; ray.init(address={cluster.state['ray_address']!r}, namespace='starjar', "
            "log_to_driver=False); print('JOINED', "
            "ray.get(ray.get_actor('starjar-controller').status.remote(), timeout=30) is not None)")
    env = _no_ray_auth()
    tries = {}
    for how, extra in (("auth disabled", {"RAY_AUTH_MODE": "disabled"}), ("token mode, no token",
                                                                           {"RAY_AUTH_MODE": "token"})):
        t0 = time.time()
        try:
            out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                                 timeout=90)
            joined = "JOINED True" in out.stdout
        except subprocess.TimeoutExpired:
            joined = False
        tries[how] = {"joined_and_called_the_controller": joined, "seconds": round(time.time() - t0, 1)}
    return tries


def _hog_stream(stub, tag: bytes, auth: tuple, stop: threading.Event, rounds: list) -> None:
    """Rounds of 256 sequences x 511 tokens from position 0, other tokens each round: all of it to prefill."""
    def requests():
        r = 0
        while not stop.is_set():
            r += 1
            yield pb.SpeculateRequest(round_id=r, sequences=[
                pb.SequenceRound(seq_id=s + 1, start=0, tokens=[5 + (s + i + r) % 300 for i in range(511)], gamma=16)
                for s in range(256)])

    try:
        for _ in stub.Speculate(requests(), metadata=(("starjar-tag", tag.hex()), *auth), timeout=600):
            rounds.append(time.time())
            if stop.is_set():
                break
    except grpc.RpcError as exc:
        rounds.append(exc.code().name)


def probe_hog(cluster: Cluster, draft: dict, hog_s: float, settle_s: float) -> dict:
    pid = draft["pid"]
    rss = lambda: psutil.Process(pid).memory_info().rss  # noqa: E731
    quiet = _window(cluster, 15)
    rss_before = rss()
    sec = Security(token=cluster.token)
    ch = sec.channel(draft["address"], options=[("grpc.max_send_message_length", 64 << 20),
                                                 ("grpc.max_receive_message_length", 64 << 20)])
    stub = pb_grpc.DraftServiceStub(ch)
    vocab, tok_hash = draft["fingerprint"].split(":", 1)
    fp = pb.ModelFingerprint(vocab_size=int(vocab), tokenizer_hash=tok_hash)
    tags, refused = [], []
    for k in range(2):
        try:
            tags.append(stub.Attach(pb.AttachRequest(worker_id=f"hog-{k}-{secrets.token_hex(4)}", fingerprint=fp),
                                    metadata=sec.metadata(), timeout=30).tag)
        except grpc.RpcError as exc:
            refused.append(exc.code().name)
    stop, rounds, peak = threading.Event(), [[] for _ in tags], [rss_before]
    streams = [threading.Thread(target=_hog_stream, args=(stub, t, tuple(sec.metadata()), stop, rounds[i]), daemon=True)
               for i, t in enumerate(tags)]
    [t.start() for t in streams]
    sampler_stop = threading.Event()

    def sample():
        while not sampler_stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.1)

    threading.Thread(target=sample, daemon=True).start()
    during = _window(cluster, hog_s)
    stop.set()
    [t.join(timeout=120) for t in streams]
    for tag in tags:
        try:
            stub.Release(pb.ReleaseRequest(tag=tag, detach=True), metadata=sec.metadata(), timeout=30)
        except grpc.RpcError:
            pass
    ch.close()
    time.sleep(2)
    sampler_stop.set()
    rss_end = rss()
    time.sleep(settle_s)
    return {"quiet_15s": quiet, f"during_{hog_s:.0f}s": during, "hog_attach_refused": refused,
            "hog_rounds_answered": [sum(isinstance(x, float) for x in r) for r in rounds],
            "hog_stream_ends": [x for r in rounds for x in r if isinstance(x, str)],
            "draft_rss_mb": {"before": rss_before >> 20, "peak": peak[0] >> 20, "2s_after": rss_end >> 20,
                             f"{settle_s + 2:.0f}s_after": rss() >> 20}}


def _stream_gaps(http_base: str, model: str) -> float:
    """A streamed completion's largest gap between chunks, in seconds."""
    host, port = http_base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = json.dumps({"model": model, "prompt": [5 + j for j in range(PROMPT_LEN)], "max_tokens": 400,
                       "temperature": 0, "stream": True})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    last, worst = time.perf_counter(), 0.0
    while True:
        line = resp.fp.readline()
        if not line:
            break
        now = time.perf_counter()
        if line.startswith(b"data:"):
            worst, last = max(worst, now - last), now
    conn.close()
    return worst


def _flood_one(http_base: str, model: str, body: bytes, codes: list) -> None:
    host, port = http_base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        codes.append(conn.getresponse().status)
    except OSError as exc:
        codes.append(type(exc).__name__)
    finally:
        conn.close()


def probe_flood(cluster: Cluster, model: str) -> dict:
    http_base = cluster.addrs["http"]
    alone = [_stream_gaps(http_base, model) for _ in range(2)]
    # A valid JSON body of 3.7 MB: a prompt of token ids, refused for its length only once parsed.
    body = json.dumps({"model": model, "prompt": [7] * 1_230_000, "max_tokens": 1}).encode()
    codes, worst = [], []
    stream = threading.Thread(target=lambda: worst.append(_stream_gaps(http_base, model)))
    stream.start()
    time.sleep(0.3)
    flood = [threading.Thread(target=_flood_one, args=(http_base, model, body, codes)) for _ in range(24)]
    [t.start() for t in flood]
    [t.join() for t in flood]
    stream.join()
    return {"body_bytes": len(body), "worst_gap_ms_alone": [round(g * 1000) for g in alone],
            "worst_gap_ms_under_flood": round(worst[0] * 1000), "flood_answers": sorted(set(map(str, codes)))}


def probe_sockets(cluster: Cluster, target: dict, n: int = 2000) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 512)), hard))
    proc = psutil.Process(target["pid"])
    before = {"threads": proc.num_threads(), "fds": proc.num_fds()}
    host, port = target["metrics"].rsplit(":", 1)
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=10)
        socks.append(s)
    time.sleep(2)
    during = {"threads": proc.num_threads(), "fds": proc.num_fds()}
    t0 = time.perf_counter()
    try:
        answered = "starjar_target" in cluster.scrape(target["metrics"])
    except OSError:
        answered = False
    scrape_ms = round((time.perf_counter() - t0) * 1000)
    [s.close() for s in socks]
    return {"idle_sockets": n, "before": before, "during": during, "scrape_answered": answered,
            "scrape_ms": scrape_ms}


def _phase(what: str, fn, *args) -> dict:
    """One attack; a failure of the probe itself (a timeout) is recorded, and the next attack still runs."""
    _say(what)
    try:
        return fn(*args)
    except Exception as exc:  # recorded in the result: an attack that breaks the probe is a finding too
        _say(f"  failed: {type(exc).__name__}: {exc}")
        return {"probe_failed": f"{type(exc).__name__}: {exc}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", default=str(ROOT), help="the starjar checkout the cluster runs (default: this)")
    p.add_argument("--hog-s", type=float, default=40.0)
    p.add_argument("--settle-s", type=float, default=20.0)
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="starjar-hostile-") as tmp:
        root = Path(tmp)
        models = _models(root / "models")
        home = root / "home"
        home.mkdir()
        cluster = Cluster(Path(args.checkout).resolve(), models, home, secrets.token_urlsafe(32))
        load = None
        try:
            status = cluster.status()["actors"]
            draft = status["starjar-draft"]
            target = status["starjar-target-0"]
            load = Load(cluster.addrs["grpc"])
            out = {"ray": _phase("ray: joining without the token", probe_ray, cluster)}
            out["hog"] = _phase("hog: two streams of 256 x 511 tokens", probe_hog, cluster, draft, args.hog_s,
                                args.settle_s)
            load.close()
            out["load"] = {"requests_done": load.done, "request_errors": load.errors}
            out["flood"] = _phase("flood: 24 x 3.7 MB bodies beside a stream", probe_flood, cluster,
                                  Path(models["target"]).name)
            out["sockets"] = _phase("sockets: 2,000 idle connections to a metrics port", probe_sockets, cluster,
                                    target)
        finally:
            if load is not None:
                load.stop.set()
            cluster.close()
    result = {"meta": result_meta(probe="hostile_neighbour", cluster_ran=git_state(Path(args.checkout))), **out}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
