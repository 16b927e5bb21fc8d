"""Write starjar's Grafana dashboards (deploy/grafana/dashboards/*.json) from the panel list below.

  python deploy/grafana/build_dashboards.py           write the JSON files
  python deploy/grafana/build_dashboards.py --check   exit 1 if the committed files differ

Every panel queries through the `datasource` variable, uses $__rate_interval in
rates, and names the metrics it reads in its description (found in its queries).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards"
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "[$__rate_interval]"


def rate(metric: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{RI}))"


def quantile(q: float, hist: str, by: str = "") -> str:
    extra = f", {by}" if by else ""
    return f"histogram_quantile({q}, sum by (le{extra}) (rate({hist}_bucket{RI})))"


def mean(hist: str, by: str = "") -> str:
    return f"{rate(hist + '_sum', by)} / {rate(hist + '_count', by)}"


# (title, unit, [(expr, legend)], panel type)
OVERVIEW = [
    ("Requests finished per second", "reqps",
     [(rate("starjar_target_requests_finished_total", "finish_reason"), "{{finish_reason}}")], "timeseries"),
    ("Output tokens per second", "short",
     [(rate("starjar_target_generation_tokens_total"), "all workers"),
      (rate("starjar_target_generation_tokens_total", "worker"), "{{worker}}")], "timeseries"),
    ("Time to first token", "s",
     [(quantile(q, "starjar_target_time_to_first_token_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)],
     "timeseries"),
    ("Time per output token (inter-token latency)", "s",
     [(quantile(q, "starjar_target_inter_token_latency_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)],
     "timeseries"),
    ("End-to-end request latency", "s",
     [(quantile(q, "starjar_target_e2e_request_latency_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.99)],
     "timeseries"),
    ("Requests running and waiting", "short",
     [("sum(starjar_target_requests_running)", "running"), ("sum(starjar_target_requests_waiting)", "waiting")],
     "timeseries"),
    ("KV cache use per worker", "percentunit", [("starjar_target_kv_usage_ratio", "{{worker}}")], "timeseries"),
    ("Requests in flight at the front end", "short",
     [("starjar_frontend_in_flight_requests", "{{worker}}")], "timeseries"),
    ("Versions and models", "none",
     [("starjar_build_info", "{{component}} {{version}} {{target_model}} {{draft_model}}")], "table"),
]

SPECULATION = [
    ("Acceptance rate", "percentunit",
     [(f"{rate('starjar_target_spec_decode_num_accepted_tokens_total')} / "
       f"{rate('starjar_target_spec_decode_num_draft_tokens_total')}", "accepted / drafted")], "timeseries"),
    ("Mean accepted length (tokens per speculative round)", "short",
     [(f"1 + {rate('starjar_target_spec_decode_num_accepted_tokens_total')} / "
       f"{rate('starjar_target_spec_decode_num_drafts_total')}", "accepted + bonus")], "timeseries"),
    ("Acceptance by draft position", "percentunit",
     [(f"{rate('starjar_target_spec_decode_num_accepted_tokens_per_pos_total', 'position')} / scalar("
       f"{rate('starjar_target_spec_decode_num_drafts_total')})", "position {{position}}")], "timeseries"),
    ("Gamma chosen, by batch size", "short",
     [("max by (batch_bucket) (starjar_target_gamma)", "batch {{batch_bucket}}")], "timeseries"),
    ("Decode steps per second, by gamma", "short",
     [(rate("starjar_target_spec_steps_total", "gamma"), "gamma {{gamma}}")], "timeseries"),
    ("Draft fallbacks per second, by reason", "short",
     [(rate("starjar_target_draft_fallbacks_total", "reason"), "{{reason}}")], "timeseries"),
    ("Draft round as the target sees it: wire, queue, compute (p50)", "s",
     [(quantile(0.5, "starjar_target_draft_round_part_seconds", "part"), "{{part}}"),
      (quantile(0.5, "starjar_target_draft_round_seconds"), "whole round")], "timeseries"),
    ("Workers attached to the draft server", "short",
     [("sum(starjar_target_draft_attached)", "attached")], "timeseries"),
]

DRAFT_SERVER = [
    ("Load (busy fraction)", "percentunit",
     [(f"{rate('starjar_draft_busy_time_seconds_total')} / ({rate('starjar_draft_busy_time_seconds_total')} + "
       f"{rate('starjar_draft_idle_time_seconds_total')})", "window"),
      ("starjar_draft_load_ratio", "since start")], "timeseries"),
    ("Queue depth", "short", [("starjar_draft_queue_depth", "rounds waiting")], "timeseries"),
    ("Queue wait T_wait", "s",
     [(mean("starjar_draft_queue_wait_seconds"), "mean"),
      (quantile(0.99, "starjar_draft_queue_wait_seconds"), "p99")], "timeseries"),
    ("Idle gap T_idle", "s", [(mean("starjar_draft_idle_gap_seconds"), "mean")], "timeseries"),
    ("Draft step t_s and service time S", "s",
     [(mean("starjar_draft_step_seconds"), "t_s (one pass)"), (mean("starjar_draft_service_seconds"), "S (one round)")],
     "timeseries"),
    ("Round rate R_q and per target R_p", "short",
     [(rate("starjar_draft_rounds_total"), "R_q (all)"),
      (rate("starjar_draft_target_rounds_total", "target"), "R_p {{target}}")], "timeseries"),
    ("Sequences per draft pass", "short",
     [(mean("starjar_draft_batch_sequences"), "mean sequences"), (mean("starjar_draft_batch_rounds"), "mean rounds")],
     "timeseries"),
    ("N_full vs N_max vs attached", "short",
     [("starjar_controller_n_full", "N_full"), ("starjar_controller_n_max", "N_max"),
      ("starjar_draft_attached_targets", "attached")], "timeseries"),
    ("Offload state and reload time", "short",
     [("starjar_draft_offloaded", "offloaded (1 = yes)"),
      (f"{rate('starjar_draft_reload_seconds_count')}", "reloads per second")], "timeseries"),
    ("Refusals and lease reclaims per second", "short",
     [(rate("starjar_draft_refusals_total", "reason"), "refused: {{reason}}"),
      (rate("starjar_draft_reclaimed_sequences_total"), "reclaimed sequences")], "timeseries"),
    ("Actor restarts", "short", [("starjar_controller_actor_restarts_total", "{{actor}}")], "timeseries"),
]

DASHBOARDS = {
    "starjar-overview": ("starjar / Overview", OVERVIEW),
    "starjar-speculation": ("starjar / Speculation", SPECULATION),
    "starjar-draft-server": ("starjar / Draft server", DRAFT_SERVER),
}


def metrics_of(expr: str) -> list[str]:
    names = re.findall(r"\bstarjar_[a-z0-9_]+", expr)
    return sorted({re.sub(r"_(bucket|sum|count)$", "", n) for n in names})


def panel(pid: int, title: str, unit: str, queries: list[tuple[str, str]], kind: str) -> dict:
    names = sorted({m for e, _ in queries for m in metrics_of(e)})
    p = {"id": pid, "type": kind, "title": title, "datasource": DS,
         "description": "Metrics: " + ", ".join(names),
         "gridPos": {"h": 8, "w": 12, "x": 12 * ((pid - 1) % 2), "y": 8 * ((pid - 1) // 2)},
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
         "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": e, "legendFormat": legend,
                      **({"format": "table", "instant": True} if kind == "table" else {})}
                     for i, (e, legend) in enumerate(queries)]}
    if kind == "timeseries":
        p["options"] = {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}}
    return p


def dashboard(uid: str, title: str, panels: list) -> dict:
    return {
        "uid": uid, "title": title, "tags": ["starjar"], "editable": True, "schemaVersion": 39, "version": 1,
        "time": {"from": "now-30m", "to": "now"}, "refresh": "10s", "timezone": "",
        "templating": {"list": [{"name": "datasource", "label": "Data source", "type": "datasource",
                                 "query": "prometheus", "current": {}, "hide": 0, "refresh": 1, "regex": "",
                                 "options": []}]},
        "panels": [panel(i + 1, *p) for i, p in enumerate(panels)],
    }


def render() -> dict[str, str]:
    return {f"{uid}.json": json.dumps(dashboard(uid, title, panels), indent=2) + "\n"
            for uid, (title, panels) in DASHBOARDS.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    files = render()
    if args.check:
        stale = [n for n, text in files.items() if not (OUT / n).exists() or (OUT / n).read_text() != text]
        if stale:
            print(f"stale dashboards: {stale}; run python deploy/grafana/build_dashboards.py", file=sys.stderr)
            return 1
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (OUT / name).write_text(text)
    print(f"wrote {len(files)} dashboards to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
