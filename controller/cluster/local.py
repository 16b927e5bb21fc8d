"""A starjar cluster on this machine: its spec, its state file, and the keeper process that owns it.

`start_local` starts the keeper (`python -m controller.cluster.keeper`, see keeper.py),
relays its progress and returns the cluster's addresses once it serves; the
keeper writes $STARJAR_HOME/run/cluster.json, which says where it and the
cluster are. `stop_local` sends the keeper SIGTERM (it drains, then shuts Ray
down) and reaps whatever process of the cluster is left.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from controller.cluster.spec import RAY_TOKEN_FILE, ClusterSpec, run_dir
from starjar.errors import StarjarError


def cluster_token() -> str | None:
    """The running local cluster's token (its metrics endpoints require it too), from its spec file."""
    try:
        return json.loads((run_dir() / "spec.json").read_text()).get("cluster_token")
    except (OSError, ValueError):
        return None


def state_path() -> Path:
    return run_dir() / "cluster.json"


def _with_default_pair(target: str | None, draft: str | None, no_draft: bool) -> tuple[str, str | None]:
    """The default pair's model for what is missing (built offline if needed)."""
    if target is None or (draft is None and not no_draft):
        from starjar.model.default_pair import build_default_pair

        pair = build_default_pair()
        target, draft = target or pair["target"], draft or pair["draft"]
    return target, draft


def local_spec(target: str | None = None, draft: str | None = None, no_draft: bool = False,
               **fields) -> ClusterSpec:
    """A validated ClusterSpec; a missing target or draft is the default pair's (built offline if needed)."""
    target, draft = _with_default_pair(target, draft, no_draft)
    fields.setdefault("prometheus_sd", str(run_dir() / "prometheus_sd.json"))
    if not fields.get("cluster_token"):  # no internal port is ever open: a fresh secret per cluster
        fields["cluster_token"] = secrets.token_urlsafe(32)
    return ClusterSpec(target=os.path.abspath(target), draft=None if no_draft else os.path.abspath(draft),
                       **fields).validate()


def adaptive_defaults(target: str | None, draft: str | None, no_draft: bool, gamma: int | None,
                      policy: str | None):
    """The speculation a cluster runs when the user forces none: measured on this machine (see spec_defaults).
    The default pair is measured now if `starjar models build` has not measured it here yet."""
    from controller.tuning.spec_defaults import speculation_defaults

    measure = target is None and draft is None and not no_draft
    target, draft = _with_default_pair(target, draft, no_draft)
    chosen = speculation_defaults(None if no_draft else draft, gamma, policy, measure=measure, target_dir=target)
    print(f"speculation: {chosen.note}", file=sys.stderr)
    return chosen


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_state() -> dict | None:
    """The running local cluster's state file, or None (a stale file of a dead keeper is removed)."""
    path = state_path()
    if not path.exists():
        return None
    state = json.loads(path.read_text())
    if not alive(state["keeper_pid"]):
        path.unlink(missing_ok=True)
        _remove_scrape_files(_read_spec())  # its keeper died without `starjar down`: the files are stale too
        return None
    return state


def start_local(spec: ClusterSpec) -> dict:
    """Start the keeper, show its progress on stderr, return the addresses once everything serves."""
    state = read_state()
    if state is not None:
        raise StarjarError(f"a starjar cluster is already running (keeper pid {state['keeper_pid']}); "
                           "run `starjar down` first")
    run_dir().mkdir(mode=0o700, parents=True, exist_ok=True)
    log_path = run_dir() / "cluster.log"
    spec_path = run_dir() / "spec.json"
    # No cluster runs: an earlier one's SD file and token would send Prometheus to dead ports with a stale token
    # until the controller writes this one's.
    _remove_scrape_files(_read_spec())
    _write_private(spec_path, json.dumps(spec.to_dict()))  # it holds the tokens
    # Ray's control plane requires this token (the keeper and every process joining it read it, see
    # local_ray_env): without it, any local process could join Ray and run code as this user.
    _write_private(run_dir() / RAY_TOKEN_FILE, secrets.token_hex(32))
    with open(log_path, "ab") as log_file:
        keeper = subprocess.Popen([sys.executable, "-m", "controller.cluster.keeper", str(spec_path),
                                   str(state_path())],
                                  stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
                                  start_new_session=True, text=True,
                                  # What the cluster writes is owner-only from its creation: the file-SD
                                  # JSON among it (created 0644 by controller.cluster.metrics, 0600 under this umask).
                                  umask=0o077)
    t0 = time.time()
    for line in keeper.stdout:
        msg = json.loads(line)
        if "progress" in msg:
            print(f"[{time.time() - t0:5.1f}s] {msg['progress']}", file=sys.stderr, flush=True)
        elif "ready" in msg:
            keeper.stdout.close()
            return msg["ready"]
        elif "error" in msg:
            break
    keeper.wait(timeout=60)
    _remove_scrape_files(spec.to_dict())  # what the controller wrote before the start failed
    raise StarjarError(f"the cluster did not start; see {log_path}:\n" + _tail(log_path))


def _write_private(path: Path, text: str) -> None:
    """Created afresh, owner-only from its first byte."""
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text)


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def stop_local() -> tuple[int, int] | None:
    """SIGTERM the keeper, wait for every process of the cluster to end; (processes, killed), or None."""
    path = state_path()
    if not path.exists():
        return None
    state = json.loads(path.read_text())
    keeper = state["keeper_pid"]
    pids = set(state.get("pids", [])) | set(_descendants(keeper))  # actors restarted since `up` included
    if alive(keeper):
        os.kill(keeper, signal.SIGTERM)  # the keeper drains the cluster, then shuts Ray down
    left = _wait_gone([keeper, *pids], state.get("drain_timeout_s", 30.0) + 60.0)
    for pid in left:  # what ray.shutdown() did not take with it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    path.unlink(missing_ok=True)
    _remove_scrape_files(_read_spec())  # after the controller is gone: nothing writes them again
    (run_dir() / RAY_TOKEN_FILE).unlink(missing_ok=True)  # after every Ray process: none reads it again
    return len(pids) + 1, len(left)


def _read_spec() -> dict:
    try:
        return json.loads((run_dir() / "spec.json").read_text())
    except (OSError, ValueError):
        return {}


def _remove_scrape_files(spec: dict) -> None:
    """The file-SD JSON and the token beside it, once no cluster of this $STARJAR_HOME runs: those in its run
    directory always (only its own cluster writes there), those at a `--prometheus-sd` path only while the
    token there is this cluster's (another cluster may have taken the path over since)."""
    from controller.cluster.metrics import SCRAPE_TOKEN_FILE

    default = run_dir() / "prometheus_sd.json"
    paths = [default, default.with_name(SCRAPE_TOKEN_FILE)]
    sd = spec.get("prometheus_sd")
    if sd and Path(sd).resolve() != default.resolve():
        token_file = Path(sd).with_name(SCRAPE_TOKEN_FILE)
        try:
            ours = token_file.read_text().strip() == (spec.get("cluster_token") or "none")
        except OSError:
            ours = False
        if ours:
            paths += [Path(sd), token_file]
    for p in paths:
        p.unlink(missing_ok=True)


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        left = [p for p in pids if alive(p) and not _is_zombie(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if alive(p) and not _is_zombie(p)]


def _descendants(pid: int) -> list[int]:
    try:
        import psutil

        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except Exception:
        return []


def _is_zombie(pid: int) -> bool:
    try:
        import psutil

        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except Exception:
        return False
