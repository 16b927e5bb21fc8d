"""Write starjar's Grafana dashboards (deploy/grafana/dashboards/*.json) from the panel list below.

  python deploy/grafana/build_dashboards.py           write the JSON files
  python deploy/grafana/build_dashboards.py --check   exit 1 if the committed files differ

The JSON is built with Grafana's own dashboards-as-code SDK (grafana-foundation-sdk,
types generated from Grafana 11.6's schemas; in the `test` extra), so a field
Grafana does not know fails here rather than in Grafana. Every panel queries
through the `datasource` variable, uses $__rate_interval in rates, and names the
metrics it reads in its description (found in its queries).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import NamedTuple

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common, units
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableHide
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUT = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RI = "[$__rate_interval]"
PANEL_HEIGHT, PANEL_WIDTH = 8, 12  # two panels per row; the dashboard builder places them left to right


class Panel(NamedTuple):
    title: str
    unit: str
    queries: list[tuple[str, str]]  # (PromQL, legend)
    kind: str = "timeseries"  # or "table" (instant queries)


def rate(metric: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{RI}))"


def quantile(q: float, hist: str, by: str = "") -> str:
    extra = f", {by}" if by else ""
    return f"histogram_quantile({q}, sum by (le{extra}) (rate({hist}_bucket{RI})))"


def mean(hist: str, by: str = "") -> str:
    return f"{rate(hist + '_sum', by)} / {rate(hist + '_count', by)}"


def quantiles(hist: str, qs: tuple[float, ...]) -> list[tuple[str, str]]:
    return [(quantile(q, hist), f"p{int(q * 100)}") for q in qs]


ACCEPTED = rate("starjar_target_spec_decode_num_accepted_tokens_total")
DRAFTS = rate("starjar_target_spec_decode_num_drafts_total")
BUSY, IDLE = rate("starjar_draft_busy_time_seconds_total"), rate("starjar_draft_idle_time_seconds_total")
LA_HITS, LA_MISSES = rate("starjar_draft_lookahead_hits_total"), rate("starjar_draft_lookahead_misses_total")
LA_BRANCH_HITS = rate("starjar_draft_lookahead_branch_hits_total")

OVERVIEW = [
    Panel("Requests finished per second", units.RequestsPerSecond,
          [(rate("starjar_target_requests_finished_total", "finish_reason"), "{{finish_reason}}")]),
    Panel("Output tokens per second", units.Short,
          [(rate("starjar_target_generation_tokens_total"), "all workers"),
           (rate("starjar_target_generation_tokens_total", "worker"), "{{worker}}")]),
    Panel("Time to first token", units.Seconds,
          quantiles("starjar_target_time_to_first_token_seconds", (0.5, 0.9, 0.99))),
    Panel("Time per output token (inter-token latency)", units.Seconds,
          quantiles("starjar_target_inter_token_latency_seconds", (0.5, 0.9, 0.99))),
    Panel("End-to-end request latency", units.Seconds,
          quantiles("starjar_target_e2e_request_latency_seconds", (0.5, 0.99))),
    Panel("Requests running and waiting", units.Short,
          [("sum(starjar_target_requests_running)", "running"), ("sum(starjar_target_requests_waiting)", "waiting")]),
    Panel("KV cache use per worker", units.PercentUnit, [("starjar_target_kv_usage_ratio", "{{worker}}")]),
    Panel("Requests in flight at the front end", units.Short,
          [("starjar_frontend_in_flight_requests", "{{worker}}")]),
    Panel("Versions and models", units.NoUnit,
          [("starjar_build_info", "{{component}} {{version}} {{target_model}} {{draft_model}}")], "table"),
]

SPECULATION = [
    Panel("Acceptance rate", units.PercentUnit,
          [(f"{ACCEPTED} / {rate('starjar_target_spec_decode_num_draft_tokens_total')}", "accepted / drafted")]),
    Panel("Mean accepted length (tokens per speculative round)", units.Short,
          [(f"1 + {ACCEPTED} / {DRAFTS}", "accepted + bonus")]),
    Panel("Acceptance by draft position", units.PercentUnit,
          [(f"{rate('starjar_target_spec_decode_num_accepted_tokens_per_pos_total', 'position')} / scalar({DRAFTS})",
            "position {{position}}")]),
    Panel("Gamma chosen, by batch size", units.Short,
          [("max by (batch_bucket) (starjar_target_gamma)", "batch {{batch_bucket}}")]),
    Panel("Decode steps per second, by gamma", units.Short,
          [(rate("starjar_target_spec_steps_total", "gamma"), "gamma {{gamma}}")]),
    Panel("Draft fallbacks per second, by reason", units.Short,
          [(rate("starjar_target_draft_fallbacks_total", "reason"), "{{reason}}")]),
    Panel("Draft round as the target sees it: wire, queue, compute (p50)", units.Seconds,
          [(quantile(0.5, "starjar_target_draft_round_part_seconds", "part"), "{{part}}"),
           (quantile(0.5, "starjar_target_draft_round_seconds"), "whole round")]),
    Panel("Engine time by phase (seconds per second)", units.PercentUnit,
          [(rate("starjar_target_engine_seconds_total", "phase"), "{{phase}}")]),
    Panel("Workers attached to the draft server", units.Short, [("sum(starjar_target_draft_attached)", "attached")]),
]

DRAFT_SERVER = [
    Panel("Load (busy fraction)", units.PercentUnit,
          [(f"{BUSY} / ({BUSY} + {IDLE})", "window"), ("starjar_draft_load_ratio", "since start")]),
    Panel("Queue depth", units.Short, [("starjar_draft_queue_depth", "rounds waiting")]),
    Panel("Queue wait T_wait", units.Seconds,
          [(mean("starjar_draft_queue_wait_seconds"), "mean"),
           (quantile(0.99, "starjar_draft_queue_wait_seconds"), "p99")]),
    Panel("Idle gap T_idle", units.Seconds, [(mean("starjar_draft_idle_gap_seconds"), "mean")]),
    Panel("Draft step t_s and service time S", units.Seconds,
          [(mean("starjar_draft_step_seconds"), "t_s (one pass)"),
           (mean("starjar_draft_service_seconds"), "S (one round)")]),
    Panel("Round rate R_q and per target R_p", units.Short,
          [(rate("starjar_draft_rounds_total"), "R_q (all)"),
           (rate("starjar_draft_target_rounds_total", "target"), "R_p {{target}}")]),
    Panel("Sequences per draft pass", units.Short,
          [(mean("starjar_draft_batch_sequences"), "mean sequences"),
           (mean("starjar_draft_batch_rounds"), "mean rounds")]),
    Panel("N_full vs N_max vs attached", units.Short,
          [("starjar_controller_n_full", "N_full {{draft}}"), ("starjar_controller_n_max", "N_max {{draft}}"),
           ("starjar_draft_attached_targets", "attached")]),
    Panel("Offload state and reload time", units.Short,
          [("starjar_draft_offloaded", "offloaded (1 = yes)"),
           (rate("starjar_draft_reload_seconds_count"), "reloads per second")]),
    Panel("Refusals and lease reclaims per second", units.Short,
          [(rate("starjar_draft_refusals_total", "reason"), "refused: {{reason}}"),
           (rate("starjar_draft_reclaimed_sequences_total"), "reclaimed sequences")]),
    Panel("Actor restarts", units.Short, [("starjar_controller_actor_restarts_total", "{{actor}}")]),
    Panel("Lookahead: hit rate and idle share", units.PercentUnit,
          [(f"{LA_HITS} / ({LA_HITS} + {LA_MISSES})", "hit rate"),
           (f"{LA_BRANCH_HITS} / ({LA_HITS} + {LA_MISSES})", "hit rate on fanout branches"),
           (f"{IDLE} / ({BUSY} + {IDLE})", "idle share")]),
    Panel("Lookahead tokens per second: drafted ahead, wasted, prompts fed ahead", units.Short,
          [(rate("starjar_draft_lookahead_drafted_tokens_total"), "drafted ahead"),
           (rate("starjar_draft_lookahead_wasted_tokens_total"), "wasted"),
           (rate("starjar_draft_lookahead_prefilled_tokens_total"), "prompt tokens fed ahead")]),
]

FLEET = [
    Panel("Draft server load (controller's window)", units.PercentUnit,
          [("starjar_controller_draft_load_ratio", "{{draft}}")]),
    Panel("Targets assigned per draft server", units.Short,
          [("starjar_controller_draft_assigned_targets", "{{draft}}"),
           ("starjar_controller_n_max", "N_max {{draft}}")]),
    Panel("Assignments per second", units.Short,
          [(rate("starjar_controller_draft_assignments_total", "draft"), "{{draft}}")]),
    Panel("Reassignments per second", units.Short,
          [(rate("starjar_controller_draft_reassignments_total", "reason"), "{{reason}}")]),
    Panel("Targets without a draft server", units.Short,
          [("starjar_controller_targets_without_draft", "decoding without drafts")]),
    Panel("Draft servers up", units.Short, [('starjar_controller_actor_up{actor=~"starjar-draft.*"}', "{{actor}}")]),
]

DASHBOARDS = {
    "starjar-overview": ("starjar / Overview", OVERVIEW),
    "starjar-speculation": ("starjar / Speculation", SPECULATION),
    "starjar-draft-server": ("starjar / Draft server", DRAFT_SERVER),
    "starjar-draft-fleet": ("starjar / Draft servers (fleet)", FLEET),
}


def metrics_of(expr: str) -> list[str]:
    names = re.findall(r"\bstarjar_[a-z0-9_]+", expr)
    return sorted({re.sub(r"_(bucket|sum|count)$", "", n) for n in names})


def query(ref_id: str, expr: str, legend: str, instant: bool) -> prometheus.Dataquery:
    q = prometheus.Dataquery().ref_id(ref_id).datasource(DATASOURCE).expr(expr).legend_format(legend)
    return q.format(PromQueryFormat.TABLE).instant() if instant else q


def panel(pid: int, spec: Panel) -> timeseries.Panel | table.Panel:
    names = sorted({m for e, _ in spec.queries for m in metrics_of(e)})
    if spec.kind == "timeseries":
        builder = (timeseries.Panel()
                   .legend(common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                           .placement(common.LegendPlacement.BOTTOM).show_legend(True))
                   .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                            .sort(common.SortOrder.NONE)))
    else:
        builder = table.Panel()
    builder.id(pid).title(spec.title).datasource(DATASOURCE).description("Metrics: " + ", ".join(names))
    builder.unit(spec.unit).height(PANEL_HEIGHT).span(PANEL_WIDTH)
    for i, (expr, legend) in enumerate(spec.queries):
        builder.with_target(query(chr(ord("A") + i), expr, legend, instant=spec.kind == "table"))
    return builder


def dashboard(uid: str, title: str, panels: list[Panel]) -> dashboard_builders.Dashboard:
    datasource = (dashboard_builders.DatasourceVariable("datasource").label("Data source").type("prometheus")
                  .hide(VariableHide.DONT_HIDE).regex(""))
    board = (dashboard_builders.Dashboard(title).uid(uid).tags(["starjar"]).editable().version(1)
             .time("now-30m", "now").refresh("10s").timezone("").with_variable(datasource))
    for pid, spec in enumerate(panels, start=1):
        board.with_panel(panel(pid, spec))
    return board


def render() -> dict[str, str]:
    return {f"{uid}.json": json.dumps(dashboard(uid, title, panels).build(), cls=JSONEncoder, indent=2) + "\n"
            for uid, (title, panels) in DASHBOARDS.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description="Write (or --check) starjar's Grafana dashboards.")
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed JSON differs from the builder's")
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
