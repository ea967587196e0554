"""Prometheus metrics of a running job, served by the controller process.

Off unless ``metrics_port`` (``--falcon-metrics-port``) is set; bound to ``metrics_host``
(loopback by default: the endpoint has no authentication). Values are read at scrape
time from the controller's latest status snapshot (:class:`StatusSnapshot`, the same
one ``falconext ctl status`` shows) and from the events the controller wrote, through
the standard ``prometheus_client`` library and a registry of this job's own:

- ``falconext_rank_iteration_seconds{rank,node}``: the loop's recent iteration time per
  rank (heartbeats); ``falconext_rank_estimated_iteration_seconds{rank,node}``: the
  median over the rank's latest ``score_window`` iterations estimated from its calls
  alone, up to loop iteration ``falconext_rank_estimate_iteration{rank}``;
  ``falconext_rank_iteration{rank}``, ``falconext_rank_microbatches{rank}``;
- ``falconext_job_iteration_seconds`` (the slowest rank's: every rank waits for it) and
  ``falconext_job_iteration`` (the rank furthest behind);
- ``falconext_rank_score{rank}``, ``falconext_rank_late_seconds{rank}``,
  ``falconext_rank_compute_ratio{rank}`` (detect/scores.py);
- ``falconext_events_total{type}``: every event the controller wrote, by type;
- ``falconext_controller_state{state}``, ``falconext_muted``,
  ``falconext_strategy_in_force{strategy}`` (S1 none, S2 micro-batches, S3 roles, S4),
  ``falconext_planner_impact_seconds`` (slow time accumulated since the onset),
  ``falconext_slowdown_removed`` (while a mitigation is in force and it is known: after
  an S4 restart, the restart's, at the job's iteration time now), ``falconext_restarts_total``
  (the restarts applied: a dashboard marks them);
- ``falconext_suspension_pause_seconds`` (a summary of every suspension's longest pause);
- reliability counters: ``falconext_messages_dropped_total``,
  ``falconext_controller_errors_total``, ``falconext_redis_disconnects_total``,
  ``falconext_suspend_missed_total``, ``falconext_mitigations_failed_total``,
  ``falconext_episode_timeouts_total``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from falconext.protocol.messages import StatusSnapshot

STATES = ("tracking", "profiling", "validating", "mitigating")
STRATEGIES = ("S1", "S2", "S3", "S4")
#: reliability counter name -> the event type it counts
RELIABILITY = {
    "messages_dropped": "message_dropped",
    "controller_errors": "controller_error",
    "suspend_missed": "suspend_missed",
    "mitigations_failed": "mitigation_failed",
    "episode_timeouts": "episode_timeout",
}


def strategy_in_force(snap: StatusSnapshot) -> str:
    """S1-S4 from what the ranks run: the planner's current strategy while it has one,
    else S3 when the roles are not the launch order, S2 when the plan is uneven."""
    if snap.planner is not None and snap.planner.get("current") in STRATEGIES:
        return str(snap.planner["current"])
    roles = snap.plan.get("roles")
    if snap.plan.get("roles_in_order") is False or (roles and roles != sorted(roles)):
        return "S3"
    if snap.plan.get("even") is False:
        return "S2"
    return "S1"


class JobMetrics(Collector):
    """What a scrape sees; fed by the controller's loop (:meth:`on_event`,
    :meth:`on_snapshot`), read by the HTTP server's thread (a lock between them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snap: StatusSnapshot | None = None
        self._events: Counter[str] = Counter()
        self._pause_sum = 0.0
        self._pause_count = 0
        self._disconnects = 0

    def on_event(self, event: dict[str, Any]) -> None:
        """Count one event the controller wrote (``type`` plus its fields)."""
        with self._lock:
            kind = str(event.get("type", "?"))
            self._events[kind] += 1
            if kind == "resumed" and isinstance(event.get("pause_s"), (int, float)):
                self._pause_sum += float(event["pause_s"])
                self._pause_count += 1
            if kind == "controller_redis" and event.get("connected") is False:
                self._disconnects += 1

    def on_snapshot(self, snap: StatusSnapshot) -> None:
        """Keep the controller's latest status: the next scrape reports it."""
        with self._lock:
            self._snap = snap

    def collect(self) -> Iterator[Any]:
        """The metric families of one scrape (prometheus_client's collector protocol), from
        the latest snapshot and the events counted so far."""
        with self._lock:
            snap = self._snap
            events = dict(self._events)
            pause = (self._pause_count, self._pause_sum)
            disconnects = self._disconnects
        c = CounterMetricFamily("falconext_events", "Events the controller wrote, by type", labels=["type"])
        for kind, n in sorted(events.items()):
            c.add_metric([kind], n)
        yield c
        for name, kind in RELIABILITY.items():
            yield CounterMetricFamily(f"falconext_{name}", f"Events of type {kind}", value=events.get(kind, 0))
        yield CounterMetricFamily("falconext_redis_disconnects", "Times the controller lost Redis", value=disconnects)
        yield SummaryMetricFamily("falconext_suspension_pause_seconds", "Longest pause of each suspension",
                                  count_value=pause[0], sum_value=pause[1])
        if snap is None:
            return
        yield from _rank_metrics(snap)
        state = GaugeMetricFamily("falconext_controller_state", "1 for the controller's state", labels=["state"])
        for s in STATES:
            state.add_metric([s], 1.0 if snap.state == s else 0.0)
        yield state
        yield GaugeMetricFamily("falconext_muted", "1 while an operator muted detection and mitigation",
                                value=1.0 if snap.muted else 0.0)
        force = strategy_in_force(snap)
        strat = GaugeMetricFamily("falconext_strategy_in_force", "1 for the strategy in force", labels=["strategy"])
        for s in STRATEGIES:
            strat.add_metric([s], 1.0 if s == force else 0.0)
        yield strat
        planner = snap.planner or {}
        yield CounterMetricFamily("falconext_restarts", "Restarts (S4) applied to the job",
                                  value=max(int(planner.get("restarts") or 0), events.get("restart_requested", 0)))
        yield GaugeMetricFamily("falconext_planner_impact_seconds", "Slow time accumulated since the fail-slow's onset",
                                value=float(planner.get("impact_s") or 0.0))
        removed = planner.get("slowdown_removed")
        if isinstance(removed, (int, float)):
            yield GaugeMetricFamily("falconext_slowdown_removed", "Share of the slowdown the mitigation removed",
                                    value=float(removed))


def _rank_metrics(snap: StatusSnapshot) -> Iterator[Any]:
    ranks = snap.ranks
    loop = GaugeMetricFamily("falconext_rank_iteration_seconds", "Recent loop iteration time per rank",
                             labels=["rank", "node"])
    est = GaugeMetricFamily("falconext_rank_estimated_iteration_seconds",
                            "Median iteration time estimated from the rank's collective calls", labels=["rank", "node"])
    est_it = GaugeMetricFamily("falconext_rank_estimate_iteration", "Loop iteration of the newest estimate",
                               labels=["rank"])
    it = GaugeMetricFamily("falconext_rank_iteration", "Loop iteration per rank", labels=["rank"])
    micro = GaugeMetricFamily("falconext_rank_microbatches", "Micro-batches the rank's replica runs", labels=["rank"])
    score = GaugeMetricFamily("falconext_rank_score", "Straggler score: share of each iteration lost to the rank",
                              labels=["rank"])
    late = GaugeMetricFamily("falconext_rank_late_seconds", "Time per iteration the rank keeps its peers waiting",
                             labels=["rank"])
    ratio = GaugeMetricFamily("falconext_rank_compute_ratio", "Compute time over its peers' median", labels=["rank"])
    for r, row in sorted(ranks.items(), key=lambda kv: int(kv[0])):
        node = str(row.get("node", ""))
        loop.add_metric([r, node], float(row["iter_s"]))
        it.add_metric([r], float(row["iteration"]))
        micro.add_metric([r], float(row.get("micro") or 0))
        if row.get("score_iteration", -1) >= 0:
            est.add_metric([r, node], float(row["est_iter_s"]))
            est_it.add_metric([r], float(row["score_iteration"]))
        for fam, key in ((score, "score"), (late, "late_s"), (ratio, "compute_ratio")):
            if isinstance(row.get(key), (int, float)):
                fam.add_metric([r], float(row[key]))
    yield from (loop, est, est_it, it, micro, score, late, ratio)
    where = snap.position()
    if where is not None:
        yield GaugeMetricFamily("falconext_job_iteration_seconds", "The job's iteration time (its slowest rank's)",
                                value=where[1])
        yield GaugeMetricFamily("falconext_job_iteration", "Loop iteration of the rank furthest behind",
                                value=float(where[0]))


class MetricsServer:
    """The HTTP endpoint: ``/metrics`` of one :class:`JobMetrics`, on ``host:port``."""

    def __init__(self, metrics: JobMetrics, host: str, port: int) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(metrics)
        started = start_http_server(port, addr=host, registry=self.registry)
        self._server = started[0] if isinstance(started, tuple) else None
        self.host, self.port = host, port

    def close(self) -> None:
        """Stop serving and free the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
