"""The one configuration object of falconext.

Every threshold the pipeline uses lives here, with the value the Falcon paper gives as
the default (docs/paper.md, "The parameters falconext takes from it"), so an experiment
changes behaviour in one place and an ablation can name exactly what it changed.
The thresholds are grouped by concern, one small dataclass per phase of the pipeline
(:class:`DetectConfig`, :class:`ProfileConfig`, :class:`ControlConfig`,
:class:`ValidateConfig`, :class:`MitigateConfig`), composed into :class:`FalconConfig`.
Their names stay flat and unique: Megatron-style ``--falcon-*`` flags map onto them by
name (``--falcon-acf-threshold`` -> ``acf_threshold``, held by ``detect``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import Field, dataclass, field, fields
from typing import Any


#: a field's metadata marking it settable at run time (``falconext ctl set``): one of the
#: thresholds the controller itself decides with, so the next decision uses the new value.
#: The others are read by the ranks' detectors or by the processes when they start, and
#: ``ctl set`` refuses them rather than pretend.
RUNTIME = {"runtime_settable": True}


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


def _check_finite(obj: Any) -> None:
    """ConfigError naming the first float field of ``obj`` that is NaN or infinite."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name} must be finite, got {value!r}")


@dataclass(frozen=True)
class DetectConfig:
    """Detection on every rank (detect/, trace/): finding the period of the collective
    calls, iteration times from them, BOCD and its verification, the slide-window baseline.
    Construction raises ConfigError for a value out of range."""

    # --- period finding (detect/period.py) -------------------------------------------
    #: first lag whose autocorrelation reaches this is the recurring period (paper: 0.95)
    acf_threshold: float = 0.95
    #: a period is accepted only once the buffer holds this many repetitions of it
    acf_min_repeats: int = 3
    #: longest period, in calls, the finder looks for (no fixed small lag limit)
    max_period_calls: int = 8192
    #: calls the streaming tracker keeps while (re)finding the period
    tracker_buffer_calls: int = 32768
    #: the call stream begins at an iteration boundary (tracer installed between
    #: iterations), so its first call marks where iterations start
    stream_starts_iteration: bool = True
    #: a period of identical symbols is refined by inter-call gaps when the gap profile
    #: explains at least this share of the gap variance
    gap_profile_r2: float = 0.8
    #: a stream's long pauses (step boundaries of identical calls) count only when the
    #: longest gap is at least this many times the median gap
    long_pause_ratio: float = 20.0
    #: a period found on the calls' ops and groups alone (sizes that change every step)
    #: is taken when at least this share of its calls repeat their size within a factor
    #: of 4 one period later
    size_agreement: float = 0.9
    #: offline (batch) iteration times: a boundary is timed by the next iteration's first
    #: call when the pause before that call is below this share of the iteration
    opening_pause_share: float = 0.5

    #: a period that is N iterations plus at most this many calls inserted every N-th
    #: iteration (Megatron-LM's --log-interval timer barriers) is followed as N
    #: iterations with an insertion, not as one long iteration; 0: off. Kept small: a
    #: micro-batch repeated within an iteration leaves the step's own calls (gradient
    #: reduction, loss and norm reductions: 8 in a DP2 Megatron-LM GPT) as the remainder
    max_inserted_calls: int = 4

    #: the training loop calls falconext at every iteration (the test bed, Megatron-LM);
    #: false: a job that only has its calls, where the tracker's iteration count is the
    #: clock for events, heartbeats and suspensions. Nothing can apply a plan without the
    #: loop, so mitigation is then off whatever ``mitigation`` says
    loop_hooks: bool = True

    #: a call whose completion is still unknown this long after its issue (a handle never
    #: waited on, a CUDA event not reached) is logged without it, so the calls behind it
    #: go on to the detector; at least this many seconds ...
    pending_timeout_s: float = 2.0
    #: ... and at least this many of the rank's recent iterations (a 5 s iteration's
    #: gradient all-reduce may complete long after 2 s)
    pending_timeout_iterations: float = 3.0

    #: each rank's call log (calls/rank*.jsonl) is rotated at this size, keeping one
    #: older file: a long job keeps at most twice this on disk; 0: no cap
    call_log_max_mb: float = 256.0

    #: live tracking leaves the job's first iterations (allocation, caching, warm-up)
    #: out of the detector: they set no baseline
    tracking_warmup: int = 20

    # --- BOCD (detect/bocd.py) ---------------------------------------------------------
    #: constant hazard: prior probability of a change point at each iteration
    bocd_hazard: float = 1.0 / 250.0
    #: posterior mass needed on "a change happened recently" (paper: 0.9)
    bocd_threshold: float = 0.9
    #: "recently" = run length <= this many iterations
    bocd_recent_window: int = 15
    #: run lengths kept after pruning; each update costs O(this)
    bocd_max_run_length: int = 300
    #: iterations observed before BOCD may report anything
    bocd_warmup: int = 10

    # --- verification (detect/verify.py) -----------------------------------------------
    #: a change below this relative size is jitter (paper: 10%)
    min_slowdown: float = field(default=0.10, metadata=RUNTIME)
    #: a slowdown must hold for this many iterations before it is an event (healthy
    #: bursts last up to min_duration - 1 iterations)
    min_duration: int = 11
    #: a step larger than this (slow/healthy) may be confirmed before min_duration: w
    #: slow iterations at level L weigh w * ln(L / fast_confirm_floor); 10-iteration
    #: bursts (up to 1.8x) stay under the evidence needed. Set it above any step (e.g.
    #: 100) to confirm every fail-slow after min_duration iterations
    fast_confirm_floor: float = 1.5
    #: ... and it is confirmed once that weight reaches this (2x: 9 iterations)
    fast_confirm_evidence: float = 2.45
    #: never confirmed on fewer slow iterations than this, nor than min_duration (two
    #: spikes of up to 3 iterations can adjoin)
    min_duration_fast: int = 7
    #: ... and only a clean step is: its level at least this many robust standard
    #: deviations of its own iterations (log terms) above healthy
    fast_confirm_snr: float = 4.0
    #: an iteration of a slow run counts fully towards its duration only when it is
    #: within this many robust standard deviations (log terms) of the run's level and
    #: this many healthy standard deviations over the baseline (verify.trailing_run)
    run_band_sigmas: float = 3.0
    #: ... the standard deviation taken as at least this (log terms: 0.02 = 2%)
    run_band_floor: float = 0.02
    #: a BOCD candidate is watched for a slow run for this x min_duration iterations
    run_watch_factor: int = 2
    #: healthy iterations before a change point used as the baseline
    baseline_window: int = 100
    #: fewest healthy iterations a baseline may be computed from
    min_baseline: int = 10
    #: the post-change window is split into this many chunks; each must be slow
    sustain_chunks: int = 5
    #: an open event ends when the level is back within this fraction of the baseline
    recovery_margin: float = 0.05

    # --- slide-window baseline (detect/baselines.py) -----------------------------------
    #: recent iterations averaged and compared with the reference median
    slide_window: int = 10
    #: persistence baseline: this many iterations in a row, each slow (or each healthy)
    persistence_iterations: int = 12
    #: iterations before the recent window whose median is the reference
    slide_reference: int = 100

    def __post_init__(self) -> None:
        _check_finite(self)
        _check(0.0 < self.acf_threshold <= 1.0, "acf_threshold must be in (0, 1]")
        _check(self.acf_min_repeats >= 2, "acf_min_repeats must be >= 2")
        _check(self.max_period_calls >= 1, "max_period_calls must be >= 1")
        _check(
            self.tracker_buffer_calls >= self.acf_min_repeats * 2,
            "tracker_buffer_calls is too small for acf_min_repeats",
        )
        _check(0.0 < self.gap_profile_r2 <= 1.0, "gap_profile_r2 must be in (0, 1]")
        _check(self.long_pause_ratio > 1.0, "long_pause_ratio must be > 1")
        _check(0.0 < self.size_agreement <= 1.0, "size_agreement must be in (0, 1]")
        _check(0.0 <= self.opening_pause_share <= 1.0, "opening_pause_share must be in [0, 1]")
        _check(self.max_inserted_calls >= 0, "max_inserted_calls must be >= 0")
        _check(self.tracking_warmup >= 0, "tracking_warmup must be >= 0")
        _check(self.pending_timeout_s > 0.0, "pending_timeout_s must be > 0")
        _check(self.call_log_max_mb >= 0.0, "call_log_max_mb must be >= 0")
        _check(self.pending_timeout_iterations >= 0.0, "pending_timeout_iterations must be >= 0")
        _check(0.0 < self.bocd_hazard < 1.0, "bocd_hazard must be in (0, 1)")
        _check(0.0 < self.bocd_threshold < 1.0, "bocd_threshold must be in (0, 1)")
        _check(self.bocd_recent_window >= 1, "bocd_recent_window must be >= 1")
        _check(
            self.bocd_max_run_length > self.bocd_recent_window,
            "bocd_max_run_length must exceed bocd_recent_window",
        )
        _check(self.bocd_warmup >= 2, "bocd_warmup must be >= 2")
        _check(self.min_slowdown > 0.0, "min_slowdown must be > 0")
        _check(self.min_duration >= 1, "min_duration must be >= 1")
        _check(self.sustain_chunks >= 1, "sustain_chunks must be >= 1")
        _check(self.min_duration >= self.sustain_chunks, "min_duration must be >= sustain_chunks")
        _check(self.fast_confirm_floor > 1.0, "fast_confirm_floor must be > 1")
        _check(self.fast_confirm_evidence > 0.0, "fast_confirm_evidence must be > 0")
        _check(self.min_duration_fast >= 1, "min_duration_fast must be >= 1")
        _check(self.fast_confirm_snr >= 0.0, "fast_confirm_snr must be >= 0")
        _check(self.run_band_sigmas > 0.0, "run_band_sigmas must be > 0")
        _check(self.run_band_floor > 0.0, "run_band_floor must be > 0")
        _check(self.run_watch_factor >= 1, "run_watch_factor must be >= 1")
        _check(self.min_baseline >= 2, "min_baseline must be >= 2")
        _check(self.baseline_window >= self.min_baseline, "baseline_window must be >= min_baseline")
        _check(
            0.0 <= self.recovery_margin < self.min_slowdown,
            "recovery_margin must be in [0, min_slowdown)",
        )
        _check(self.slide_window >= 1, "slide_window must be >= 1")
        _check(self.persistence_iterations >= 1, "persistence_iterations must be >= 1")
        _check(self.slide_reference >= 1, "slide_reference must be >= 1")


@dataclass(frozen=True)
class ProfileConfig:
    """Narrowing to suspects (profile/, detect/scores.py): which groups a profile finds
    suspicious, which rank causes the waiting, and the per-rank scores the controller watches.
    Construction raises ConfigError for a value out of range."""

    # --- profiling (profile/analysis.py) ---------------------------------------------------
    #: a group is suspicious when its transfer time exceeds this x the median of
    #: comparable groups (paper: 1.1)
    suspicious_factor: float = field(default=1.1, metadata=RUNTIME)
    #: seconds of recent collective calls each rank sends when profiling starts
    profile_window_s: float = field(default=3.0, metadata=RUNTIME)
    #: the controller waits this long for every rank's profile before going on
    profile_timeout_s: float = field(default=3.0, metadata=RUNTIME)
    #: collectives smaller than this are latency, not bandwidth: not used to judge groups
    profile_min_bytes: int = field(default=65536, metadata=RUNTIME)
    #: a compute suspect imposes at least this share of all the waiting in the window ...
    wait_causer_share: float = field(default=0.5, metadata=RUNTIME)
    #: ... and this many times as much as any other rank
    wait_causer_dominance: float = field(default=3.0, metadata=RUNTIME)

    # --- per-rank scores (detect/scores.py) -------------------------------------------------
    #: a rank's score sample is the median over its latest this many iterations
    score_window: int = 10
    #: the controller publishes every rank's score this often (a ``rank_scores`` event)
    score_interval_s: float = field(default=5.0, metadata=RUNTIME)
    #: ... or less often, so that scoring every rank takes at most this share of the
    #: controller's time (about a second at 131,072 ranks on one core)
    score_max_share: float = field(default=0.1, metadata=RUNTIME)
    #: the ``rank_scores`` event and the status snapshot list every rank up to this many;
    #: a larger job's list its this many slowest (by score) and summarize all ranks
    listed_ranks: int = field(default=1024, metadata=RUNTIME)
    #: a rank whose compute per micro-batch is this many times its role peers' median, and
    #: whose lateness costs the job min_slowdown of every iteration, in
    #: score_trigger_readings scores in a row (each of a later iteration), is suspected a
    #: straggler by the controller itself: localized at once, without waiting for the
    #: detectors (which confirm over min_duration iterations, and are blind while they warm
    #: up after a restart or an S3 move, where such a fault started). 1.25: the
    #: validation's confirm line for a GPU's own compute rise; 0: off
    score_trigger_ratio: float = field(default=1.25, metadata=RUNTIME)
    score_trigger_readings: int = field(default=2, metadata=RUNTIME)
    #: the fast path (detect/steps.py, control/stragglers.py): a rank whose compute per
    #: iteration (from its own calls) reads at least fast_ratio x its own level (the median
    #: of its latest fast_baseline iterations outside a run, judged from fast_warm on) in
    #: fast_iterations iterations in a row, while the rest of the job's, read at the same
    #: iteration, are calm (nine in ten under 1 + (fast_ratio - 1) / 3) and its recent
    #: compute is fast_ratio x their median, is suspected a straggler and localized at once (the
    #: validation has the last word). A
    #: data-loader stall or a checkpoint save lifts one rank for 1-3 iterations, a burst
    #: lifts every rank: neither is a run on one rank of fast_iterations. A run of
    #: fast_rebase iterations becomes the rank's level. 0: off. Where the rank's compute is
    #: noisy, the line is the level plus fast_noise robust standard deviations of it when
    #: that is higher (the test bed's 16 ranks on two cores: about 9% apart from one
    #: iteration to the next, so 1.27x; a GPU's compute: about 1%, so fast_ratio)
    fast_ratio: float = 1.15
    fast_noise: float = 3.0
    fast_iterations: int = field(default=4, metadata=RUNTIME)
    fast_baseline: int = 16
    fast_warm: int = 8
    fast_rebase: int = 64

    def __post_init__(self) -> None:
        _check_finite(self)
        _check(self.score_window >= 1, "score_window must be >= 1")
        _check(self.score_interval_s > 0.0, "score_interval_s must be > 0")
        _check(0.0 < self.score_max_share <= 1.0, "score_max_share must be in (0, 1]")
        _check(self.listed_ranks >= 1, "listed_ranks must be >= 1")
        _check(self.score_trigger_ratio == 0.0 or self.score_trigger_ratio > 1.0,
               "score_trigger_ratio must be 0 (off) or > 1")
        _check(self.score_trigger_readings >= 1, "score_trigger_readings must be >= 1")
        _check(self.fast_ratio == 0.0 or self.fast_ratio > 1.0, "fast_ratio must be 0 (off) or > 1")
        _check(self.fast_iterations >= 1, "fast_iterations must be >= 1")
        _check(self.fast_noise >= 0.0, "fast_noise must be >= 0")
        _check(1 <= self.fast_warm <= self.fast_baseline, "fast_warm must be in [1, fast_baseline]")
        _check(self.fast_rebase > self.fast_iterations, "fast_rebase must exceed fast_iterations")
        _check(0.0 < self.wait_causer_share <= 1.0, "wait_causer_share must be in (0, 1]")
        _check(self.wait_causer_dominance >= 1.0, "wait_causer_dominance must be >= 1")
        _check(self.suspicious_factor > 1.0, "suspicious_factor must be > 1")
        _check(self.profile_window_s > 0, "profile_window_s must be > 0")
        _check(self.profile_timeout_s > 0, "profile_timeout_s must be > 0")
        _check(self.profile_min_bytes >= 0, "profile_min_bytes must be >= 0")


@dataclass(frozen=True)
class ControlConfig:
    """The control plane (control/, runtime/, elastic/): the rank side's own cost, the bus,
    heartbeats, the controller's deadlines, its status and metrics.
    Construction raises ConfigError for a value out of range."""

    # --- the rank side's own cost (runtime/, control/client.py) ------------------------------
    #: with loop hooks the monitor reads the calls once per loop iteration, woken by the
    #: loop; this is its longest sleep (a stalled loop's calls are still read)
    monitor_idle_s: float = 1.0
    #: without loop hooks the monitor has no loop to wake it and reads the calls this often
    monitor_poll_s: float = 0.05
    #: the control client waits for commands this long at a time while nothing is going
    #: on (less when a heartbeat is due sooner), and 0.1 s for control_busy_s after a
    #: command or a message of its own
    control_idle_s: float = 1.0
    control_busy_s: float = 2.0

    # --- control plane (control/) ----------------------------------------------------------
    #: run the control plane (Redis bus, agents, controller) when tracking is on
    control_plane: bool = True
    #: a Redis Cluster of this many shards (>= 3) instead of one Redis server: started by
    #: the launcher, or, with a URL given (--falcon-redis-url-file), the cluster it names;
    #: 0: one server (control/shards.py)
    redis_shards: int = 0
    #: on a Redis Cluster, a reader process per shard decodes the heartbeats for the
    #: controller (control/beat_reader.py); off: the controller decodes them itself
    beat_readers: bool = True
    #: a job of several launchers: the fewest nodes it can train on with its global batch
    #: unchanged (set by the launcher); an exclusion that no spare fills and that would
    #: take the job below it is refused. 0: one launcher, which replaces nodes itself
    restart_floor_nodes: int = 0
    #: how long a node's launcher waits for the control plane another node starts, seconds
    plane_wait_s: float = 60.0
    #: how long an excluded node's --falcon-on-exclude command may run, seconds
    on_exclude_timeout_s: float = 60.0
    #: an S4 without a node of a job of several launchers: how long the ranks that stay
    #: wait, before they exit for the next round, for the leaving node's agent to stop
    #: (elastic.restart.wait_left), seconds
    leave_wait_s: float = 30.0
    #: a rank tells the controller its loop iteration this often
    heartbeat_s: float = 0.5
    #: the controller counts as gone when its liveness key is this old
    controller_timeout_s: float = 3.0
    #: a fail-slow episode closes this long after its first end report, or after every
    #: rank reads healthy again, even when other ranks' end reports were lost
    episode_timeout_s: float = field(default=60.0, metadata=RUNTIME)
    #: times a suspension is tried when a rank missed the agreed iteration
    suspend_tries: int = field(default=3, metadata=RUNTIME)
    #: seconds the controller waits for ranks beyond their own deadlines
    control_slack_s: float = field(default=2.0, metadata=RUNTIME)
    #: heartbeats kept per rank, one per loop iteration (a later heartbeat of the same
    #: iteration replaces it, so a job of 3.5 s iterations and 0.5 s heartbeats keeps 64
    #: iterations, not 32 s): longer than detection takes from a fail-slow's onset to
    #: planning, since the compute-rise check, S2's revert and S3 read each process's
    #: compute before the onset
    heartbeat_history: int = 64
    #: a heartbeat's iteration time is the median of the rank's latest this many loop
    #: iterations, and its compute per micro-batch the upper median of its latest this
    #: many steps' readings (each the step's fastest forward: runtime.step_forward_s). The controller smooths again (the planner judges a median of
    #: mitigation_judge_iterations heartbeats, the score trigger wants
    #: score_trigger_readings of them, S2's revert mitigation_recovered_beats), so a
    #: heartbeat only has to keep a lone outlier out (a pause, a spike): five iterations
    #: keep two out, four steps one. Longer medians held every reaction back by half
    #: their length: with 12 and 8, table7's slow GPUs were suspected 8-9 iterations after
    #: their onset and S2 reverted 35 s after the fault ended
    beat_iter_window: int = 5
    beat_compute_window: int = 4
    #: the controller serves Prometheus metrics on this TCP port (0: off) ...
    metrics_port: int = 0
    #: ... bound to this address (loopback unless an operator widens it)
    metrics_host: str = "127.0.0.1"
    #: the controller publishes its status snapshot (``falconext ctl status``) this often ...
    status_interval_s: float = field(default=1.0, metadata=RUNTIME)
    #: ... or less often, so that building it (it lists every rank: 0.1 s at 4096 ranks)
    #: takes at most this share of the controller's time
    status_max_share: float = field(default=0.05, metadata=RUNTIME)
    #: node messages of heartbeats (NodeHeartbeats) the controller handles between two
    #: reads of its control stream (reports, profiles, acks, results come first)
    controller_read_batch: int = field(default=64, metadata=RUNTIME)
    #: entries kept on the streams the node agents post to (ctl, beats): more than one
    #: message per rank of the largest job, so that one message from every rank at once
    #: (profiles, acks) cannot push unread ones out
    stream_maxlen: int = 100_000

    def __post_init__(self) -> None:
        _check_finite(self)
        _check(self.episode_timeout_s > 0.0, "episode_timeout_s must be > 0")
        _check(self.suspend_tries >= 1, "suspend_tries must be >= 1")
        _check(self.control_slack_s >= 0.0, "control_slack_s must be >= 0")
        _check(self.restart_floor_nodes >= 0, "restart_floor_nodes must be >= 0")
        _check(self.plane_wait_s >= 0.0, "plane_wait_s must be >= 0")
        _check(self.redis_shards == 0 or self.redis_shards >= 3,
               "redis_shards must be 0 (one server) or >= 3 (Redis Cluster runs with at least 3 masters)")
        _check(self.on_exclude_timeout_s > 0.0, "on_exclude_timeout_s must be > 0")
        _check(self.leave_wait_s >= 0.0, "leave_wait_s must be >= 0")
        _check(self.heartbeat_history >= 1, "heartbeat_history must be >= 1")
        _check(1 <= self.beat_iter_window <= 1000, "beat_iter_window must be in [1, 1000]")
        _check(1 <= self.beat_compute_window <= 1000, "beat_compute_window must be in [1, 1000]")
        _check(0 <= self.metrics_port <= 65535, "metrics_port must be in [0, 65535]")
        _check(bool(self.metrics_host.strip()), "metrics_host must not be empty")
        _check(0.0 < self.status_interval_s <= 1.0, "status_interval_s must be in (0, 1]")
        _check(0.0 < self.status_max_share <= 1.0, "status_max_share must be in (0, 1]")
        _check(self.controller_read_batch >= 1, "controller_read_batch must be >= 1")
        _check(self.stream_maxlen >= 1000, "stream_maxlen must be >= 1000")
        _check(self.heartbeat_s > 0, "heartbeat_s must be > 0")
        _check(self.monitor_idle_s > 0 and self.monitor_poll_s > 0, "monitor_idle_s and monitor_poll_s must be > 0")
        _check(self.control_idle_s >= 0.1 and self.control_busy_s >= 0, "control_idle_s must be >= 0.1 and control_busy_s >= 0")
        _check(self.controller_timeout_s > self.heartbeat_s, "controller_timeout_s must exceed heartbeat_s")


@dataclass(frozen=True)
class ValidateConfig:
    """Suspension and validation (validate/): when the ranks suspend, for how long, and
    the GEMM and P2P benchmarks that confirm a slow GPU or link.
    Construction raises ConfigError for a value out of range."""

    # --- suspension and validation (validate/) --------------------------------------------
    #: ranks suspend this many iterations after the controller's latest view of them
    suspend_margin_iterations: int = field(default=3, metadata=RUNTIME)
    #: ... or one, when an iteration lasts at least this many seconds (0: never): the
    #: margin is time for the command to reach every rank (bus hops, read every 0.1 s),
    #: and three 3.5 s iterations of a 64-GPU job kept a fail-slow unvalidated, then
    #: unmitigated, for 7 s longer than one does, at each suspension
    suspend_margin_s: float = field(default=1.0, metadata=RUNTIME)
    #: longest a rank stays suspended, whatever happens to the controller
    suspend_deadline_s: float = field(default=4.0, metadata=RUNTIME)
    #: longest validation runs on the trapped training thread once "go" has come: checked
    #: between benchmark steps (a GEMM round, a P2P sweep), counting the next step as long
    #: as the last of its kind, and the ranks agree to stop at the same step; what was
    #: measured by then is reported, marked partial. A step that has begun is bounded by
    #: the validation group's timeout
    validation_budget_s: float = 3.0
    #: after validating a fail-slow's suspects, the ranks stay held up to this long for the
    #: verdict: when the planner decides at once (S2 for the GPU just named), the action
    #: comes with the "resume" and applies from the next iteration, instead of a second
    #: suspension one margin later (table7: two 3.5 s iterations more of the slow job per
    #: fault). The wait is normally two bus hops; 0: the ranks resume once they reported
    suspend_verdict_wait_s: float = field(default=2.0, metadata=RUNTIME)
    #: a GPU (link) is slow when its GEMM (transfer) takes this x the median
    validation_slow_factor: float = field(default=1.5, metadata=RUNTIME)
    #: and (links) slower than the reference by at least this many seconds per message.
    #: 0 on a GPU fabric, where a validation message takes microseconds and a floor in
    #: milliseconds would hide a real congestion; the CPU test bed's launcher sets 5 ms,
    #: because there host scheduling alone made healthy loopback messages read 2-4 ms
    #: (2x their peers) in CI, while an emulated x3 link reads about 30 ms
    validation_min_link_excess_s: float = field(default=0.0, metadata=RUNTIME)
    #: GEMM benchmark: n x n x n, repeats (after warm-up)
    gemm_size: int = field(default=256, metadata=RUNTIME)
    gemm_repeats: int = field(default=50, metadata=RUNTIME)
    #: ranks that run their GEMM at the same time (0: all at once, right for GPUs; the
    #: CPU test bed's launcher sets 1, because its "GPUs" share the host's cores)
    gemm_concurrency: int = field(default=0, metadata=RUNTIME)
    #: times validation runs each benchmark (every GEMM in turn, then every pass, then all
    #: again) and keeps each rank's and pair's best: a neighbour that shared the core (or
    #: its hyperthread sibling) during one short run made a healthy CPU-bed rank read 1.5x
    #: slow in CI, and a healthy loopback link 20x; that rarely happens twice, a slow GPU
    #: or a congested link is slow both times
    validation_sweeps: int = field(default=2, metadata=RUNTIME)
    #: P2P pairs of one pass that run at the same time (0: all; the CPU test bed: 1)
    p2p_concurrency: int = field(default=0, metadata=RUNTIME)
    #: P2P benchmark: message bytes and messages per pair
    p2p_bytes: int = field(default=262144, metadata=RUNTIME)
    p2p_repeats: int = field(default=5, metadata=RUNTIME)
    #: in a job on exactly two nodes the one network link between them has no peer to be
    #: compared with, so once every rank has reached this iteration the controller
    #: validates every link (one short suspension) and keeps their times as the link's
    #: healthy reference; 0: never
    link_baseline_iteration: int = field(default=10, metadata=RUNTIME)
    #: validate the edges of NCCL's double binary trees over a group's nodes as well as its
    #: ring, for groups that span nodes (validate/plan.py trees_apply): across nodes NCCL
    #: runs small and medium all-reduces as trees, so a congested link may carry tree
    #: traffic only. "auto": where the ranks' collectives run on NCCL and their NCCL_ALGO
    #: is unset or lets all-reduces use Tree/NVLSTree; "on": always (the CPU test bed, whose
    #: gloo runs rings, tests tree validation so); "off": rings only
    validation_trees: str = field(default="auto", metadata=RUNTIME)

    def __post_init__(self) -> None:
        _check_finite(self)
        _check(self.gemm_concurrency >= 0, "gemm_concurrency must be >= 0")
        _check(self.validation_sweeps >= 1, "validation_sweeps must be >= 1")
        _check(self.link_baseline_iteration >= 0, "link_baseline_iteration must be >= 0")
        _check(self.validation_trees in ("auto", "on", "off"),
               f"validation_trees must be auto, on or off, got {self.validation_trees!r}")
        _check(self.p2p_concurrency >= 0, "p2p_concurrency must be >= 0")
        _check(self.suspend_margin_iterations >= 1, "suspend_margin_iterations must be >= 1")
        _check(self.suspend_margin_s >= 0.0, "suspend_margin_s must be >= 0")
        _check(0 < self.suspend_deadline_s <= 300, "suspend_deadline_s must be in (0, 300]")
        _check(0 < self.validation_budget_s <= 300, "validation_budget_s must be in (0, 300]")
        _check(0 <= self.suspend_verdict_wait_s <= 300, "suspend_verdict_wait_s must be in [0, 300]")
        _check(self.validation_slow_factor > 1.0, "validation_slow_factor must be > 1")
        _check(self.validation_min_link_excess_s >= 0, "validation_min_link_excess_s must be >= 0")
        _check(self.gemm_size >= 16 and self.gemm_repeats >= 1, "gemm_size must be >= 16 and gemm_repeats >= 1")
        _check(self.p2p_bytes >= 1 and self.p2p_repeats >= 1, "p2p_bytes and p2p_repeats must be >= 1")


@dataclass(frozen=True)
class MitigateConfig:
    """Mitigation (mitigate/): the ski-rental planner's judgement, the strategies it may
    use, and the operator's overrides.
    Construction raises ConfigError for a value out of range."""

    # --- mitigation (mitigate/) -------------------------------------------------------------
    #: mitigate automatically once a fail-slow is localized (the ski-rental planner)
    mitigation: bool = field(default=True, metadata=RUNTIME)
    #: a strategy is "enough" when iterations are back within this fraction of healthy
    mitigation_enough_margin: float = field(default=0.10, metadata=RUNTIME)
    #: iterations after a strategy takes effect before it is judged, and judged over
    mitigation_settle_iterations: int = field(default=5, metadata=RUNTIME)
    mitigation_judge_iterations: int = field(default=5, metadata=RUNTIME)
    #: S2 is reverted once every slow GPU's compute per micro-batch (its heartbeats' median
    #: of recent iterations) is back within min_slowdown (the paper's 10% jitter line) of
    #: its own before the onset in this many fresh readings in a row; one reading over the
    #: line starts the count again (no revert on one lucky reading). Without such a
    #: reference, the slow replicas are judged against the others over
    #: mitigation_judge_iterations iterations
    mitigation_recovered_beats: int = field(default=3, metadata=RUNTIME)
    #: inside a mitigated fail-slow, the iteration time risen this fraction over the lowest
    #: level seen in it (or a strategy judged enough no longer being so) is localized
    #: again before the planner escalates: the ranks' detectors do not report a second
    #: fault that begins inside their open event (a ladder step) or while they restart
    #: after S3 (they take it as their baseline), and escalating would charge it to the
    #: first fault's culprits. 10%: the paper's line between jitter and a change
    #: (min_slowdown); 0: never (escalate whatever caused the rise)
    mitigation_relocalize_rise: float = field(default=0.10, metadata=RUNTIME)
    #: strategies the planner may use, cheapest first by measured cost (S2 rebalance
    #: micro-batches, S3 topology, S4 checkpoint-restart without the bad node); leave
    #: S4 out where no spare node exists
    mitigation_strategies: str = field(default="S2,S3,S4", metadata=RUNTIME)
    #: most micro-batches one DP replica may run per global batch (memory); 0: no cap
    max_microbatches_per_replica: int = field(default=0, metadata=RUNTIME)
    #: S4's cost is estimated, not probed with a save nobody asked for: the rank's state
    #: bytes (model and optimizer, counted in memory) over the checkpoint directory's
    #: write and read bandwidth, measured with a scratch file of at most this many bytes
    restart_probe_bytes: int = 16 << 20
    #: operator override: micro-batches per DP replica from the first iteration, e.g.
    #: "3,5" (must sum to the job's micro-batches per global batch); empty: even
    force_microbatches: str = ""
    #: operator override: switch roles at an iteration, "ITER:r0,r1,..." with r_p the
    #: torch rank process p plays from ITER on (a permutation; S3 applied by hand)
    force_topology: str = ""

    def __post_init__(self) -> None:
        _check_finite(self)
        _check(self.restart_probe_bytes >= 4096, "restart_probe_bytes must be >= 4096")
        _check(self.mitigation_relocalize_rise >= 0.0, "mitigation_relocalize_rise must be >= 0")
        _check(0.0 < self.mitigation_enough_margin < 1.0, "mitigation_enough_margin must be in (0, 1)")
        _check(
            self.mitigation_settle_iterations >= 0 and self.mitigation_judge_iterations >= 1,
            "mitigation_settle_iterations must be >= 0 and mitigation_judge_iterations >= 1",
        )
        _check(self.mitigation_recovered_beats >= 1, "mitigation_recovered_beats must be >= 1")
        _check(self.max_microbatches_per_replica >= 0, "max_microbatches_per_replica must be >= 0")
        parse_microbatches(self.force_microbatches)
        parse_topology(self.force_topology)
        _check(
            all(x in ("S2", "S3", "S4") for x in self.strategies()),
            f"mitigation_strategies must name S2, S3 or S4 separated by commas, got {self.mitigation_strategies!r}",
        )

    def strategies(self) -> set[str]:
        """The mitigation strategies the planner may use (``mitigation_strategies`` parsed)."""
        return {x.strip() for x in self.mitigation_strategies.split(",") if x.strip()}


#: the concerns FalconConfig is composed of, by the attribute that holds each
CONCERNS: dict[str, type] = {
    "detect": DetectConfig,
    "profile": ProfileConfig,
    "control": ControlConfig,
    "validate": ValidateConfig,
    "mitigate": MitigateConfig,
}

#: which concern holds each threshold, by the threshold's (flat, unique) name
OWNER: dict[str, str] = {f.name: concern for concern, kind in CONCERNS.items() for f in fields(kind)}


def threshold_fields() -> tuple[Field, ...]:
    """Every threshold's dataclass field, concern by concern, in declaration order (what the
    ``--falcon-*`` flags, ``ctl set`` and run.json name)."""
    return tuple(f for kind in CONCERNS.values() for f in fields(kind))


def runtime_settable() -> frozenset[str]:
    """The names of the fields marked :data:`RUNTIME` (what ``ctl set`` may change)."""
    return frozenset(f.name for f in threshold_fields() if f.metadata.get("runtime_settable"))


def detect_config(config: "FalconConfig | DetectConfig | None") -> DetectConfig:
    """The detection thresholds ``config`` holds: a FalconConfig's ``detect``, a DetectConfig
    itself, the defaults for None. Detection's code takes either and reads only these."""
    if config is None:
        return DetectConfig()
    if isinstance(config, FalconConfig):
        return config.detect
    if isinstance(config, DetectConfig):
        return config
    raise ConfigError(f"expected a FalconConfig or DetectConfig, got {type(config).__name__}")


@dataclass(frozen=True, init=False)
class FalconConfig:
    """Every threshold and setting of falconext, one source: the paper's values as defaults,
    each field documented where it is declared, grouped by concern (``detect``,
    ``profile``, ``control``, ``validate``, ``mitigate``: one small dataclass each, which a
    phase's code may take alone).

    Thresholds are named flat, as the ``--falcon-*`` flags, ``ctl set`` and run.json name
    them: ``FalconConfig(min_slowdown=0.2)`` sets ``cfg.detect.min_slowdown``, which
    ``cfg.min_slowdown`` reads; a whole concern may be given instead
    (``FalconConfig(detect=DetectConfig(...))``), with flat names applied over it. An
    unknown name is a ConfigError; a value out of range too (checked by its concern). A
    job without loop hooks cannot apply a plan, so its ``mitigation`` is off."""

    detect: DetectConfig
    profile: ProfileConfig
    control: ControlConfig
    validate: ValidateConfig
    mitigate: MitigateConfig

    def __init__(self, *, detect: DetectConfig | None = None, profile: ProfileConfig | None = None,
                 control: ControlConfig | None = None, validate: ValidateConfig | None = None,
                 mitigate: MitigateConfig | None = None, **thresholds: Any) -> None:
        unknown = sorted(set(thresholds) - set(OWNER))
        if unknown:
            raise ConfigError(f"unknown FalconConfig field(s): {', '.join(unknown)}")
        given = {"detect": detect, "profile": profile, "control": control, "validate": validate,
                 "mitigate": mitigate}
        for concern, kind in CONCERNS.items():
            part = given[concern]
            if part is not None and not isinstance(part, kind):
                raise ConfigError(f"{concern} must be a {kind.__name__}, got {type(part).__name__}")
            mine = {k: v for k, v in thresholds.items() if OWNER[k] == concern}
            if part is None:
                part = kind(**mine)
            elif mine:
                part = dataclasses.replace(part, **mine)
            object.__setattr__(self, concern, part)
        if not self.detect.loop_hooks and self.mitigate.mitigation:
            # nothing could apply a plan
            object.__setattr__(self, "mitigate", dataclasses.replace(self.mitigate, mitigation=False))

    def strategies(self) -> set[str]:
        """The mitigation strategies the planner may use (``mitigation_strategies`` parsed)."""
        return self.mitigate.strategies()

    def replace(self, **changes: Any) -> "FalconConfig":
        """A copy with some thresholds changed (flat names); unknown names are an error, not ignored."""
        return FalconConfig(**{**{c: getattr(self, c) for c in CONCERNS}, **changes})

    def to_dict(self) -> dict[str, Any]:
        """Every threshold by its flat name, as plain JSON-able values (run.json's
        ``falcon_config``; ``FalconConfig(**d)`` reads it back)."""
        return {f.name: getattr(getattr(self, OWNER[f.name]), f.name) for f in threshold_fields()}


def _flat(concern: str, name: str) -> property:
    """A read-only attribute of FalconConfig reading threshold ``name`` from its concern."""
    return property(lambda self: getattr(getattr(self, concern), name),
                    doc=f"``{concern}.{name}`` (the flat name of a threshold)")


for _name, _concern in OWNER.items():
    setattr(FalconConfig, _name, _flat(_concern, _name))
del _name, _concern


def parse_topology(text: str) -> tuple[int, list[int]] | None:
    """``"30:0,2,1,3"`` -> (30, [0, 2, 1, 3]); empty -> None. That the roles are a
    permutation of the job's ranks is checked where the world size is known."""
    if not text.strip():
        return None
    it, sep, roles = text.partition(":")
    parts = [p.strip() for p in roles.split(",")]
    if not sep or not it.strip().isdigit() or not all(p.isdigit() for p in parts):
        raise ConfigError(f"force_topology must be ITERATION:ROLES (e.g. 30:0,2,1,3), got {text!r}")
    return int(it), [int(p) for p in parts]


def parse_microbatches(text: str) -> list[int] | None:
    """``"3,5"`` -> [3, 5]; empty -> None. Every count must be a positive integer."""
    if not text.strip():
        return None
    counts = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ConfigError(
                f"force_microbatches must be positive integers separated by commas (e.g. 3,5), got {text!r}"
            )
        counts.append(int(part))
    return counts


def field_value(name: str, value: Any) -> Any:
    """``value`` as FalconConfig field ``name``'s type, or ConfigError naming the problem.

    A string is parsed the way ``--falcon-<name>`` parses it (``falconext ctl set``); any
    other value must already be of the field's type (JSON from the control plane: an
    integer is accepted for a float field, a bool never for a number). Ranges are not
    checked here: a config built with the value checks them (``FalconConfig.replace``).
    """
    defaults = FalconConfig()
    if name not in OWNER:
        raise ConfigError(f"unknown threshold {name!r} (a FalconConfig field, e.g. min_slowdown)")
    kind = type(getattr(defaults, name))
    if isinstance(value, str) and kind is not str:
        try:
            value = _parse_bool(value) if kind is bool else kind(value.strip())
        except (ValueError, argparse.ArgumentTypeError):
            raise ConfigError(f"{name} takes a {kind.__name__}, got {value!r}") from None
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ConfigError(f"{name} takes a {kind.__name__}, got {value!r}")
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return value


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one ``--falcon-<field>`` option per FalconConfig field (Megatron-style names)."""
    defaults = FalconConfig()
    groups = {concern: parser.add_argument_group(
        f"falcon thresholds: {concern} (defaults: the paper's values)") for concern in CONCERNS}
    for f in threshold_fields():
        group = groups[OWNER[f.name]]
        kind = type(getattr(defaults, f.name))
        group.add_argument(
            "--falcon-" + f.name.replace("_", "-"),
            dest="falcon_" + f.name,
            type=_parse_bool if kind is bool else kind,
            default=None,
            metavar=kind.__name__.upper(),
            help=f"default {getattr(defaults, f.name)!r}",
        )


def config_from_args(args: argparse.Namespace) -> FalconConfig:
    """The FalconConfig the ``--falcon-*`` options describe (unset ones keep defaults)."""
    changes = {
        f.name: getattr(args, "falcon_" + f.name)
        for f in threshold_fields()
        if getattr(args, "falcon_" + f.name, None) is not None
    }
    return FalconConfig(**changes)


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
