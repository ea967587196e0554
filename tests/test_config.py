"""FalconConfig composed of one small dataclass per concern, with flat threshold names."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle

import pytest

from falconext.config import (
    CONCERNS,
    OWNER,
    ConfigError,
    ControlConfig,
    DetectConfig,
    FalconConfig,
    MitigateConfig,
    add_config_arguments,
    config_from_args,
    detect_config,
    runtime_settable,
    threshold_fields,
)
from falconext.detect.verify import VerifiedBOCD


def test_each_threshold_has_one_concern_and_the_flat_name_reads_it() -> None:
    cfg = FalconConfig()
    names = [f.name for f in threshold_fields()]
    assert len(names) == len(set(names)) == len(OWNER)
    assert set(CONCERNS) == {"detect", "profile", "control", "validate", "mitigate"}
    for name, concern in OWNER.items():
        assert getattr(cfg, name) == getattr(getattr(cfg, concern), name)
    # the thresholds of a phase sit with that phase
    assert OWNER["bocd_hazard"] == "detect" and OWNER["suspicious_factor"] == "profile"
    assert OWNER["heartbeat_s"] == "control" and OWNER["gemm_size"] == "validate"
    assert OWNER["mitigation_strategies"] == "mitigate"


def test_flat_construction_sets_the_owning_concern_and_round_trips_through_run_json() -> None:
    cfg = FalconConfig(min_slowdown=0.2, heartbeat_s=0.3, gemm_size=64, mitigation_strategies="S2")
    assert cfg.detect.min_slowdown == 0.2 and cfg.control.heartbeat_s == 0.3
    assert cfg.validate.gemm_size == 64 and cfg.strategies() == {"S2"}
    d = json.loads(json.dumps(cfg.to_dict()))
    assert set(d) == set(OWNER)  # flat, as run.json has always had it
    assert FalconConfig(**d) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg and hash(cfg) == hash(FalconConfig(**d))


def test_a_whole_concern_may_be_given_and_flat_names_apply_over_it() -> None:
    detect = DetectConfig(min_duration=15)
    cfg = FalconConfig(detect=detect, min_slowdown=0.3)
    assert cfg.min_duration == 15 and cfg.min_slowdown == 0.3 and cfg.detect is not detect
    assert cfg.replace(min_duration=12).detect == dataclasses.replace(cfg.detect, min_duration=12)
    assert dataclasses.replace(cfg, heartbeat_s=0.25).control == ControlConfig(heartbeat_s=0.25)
    with pytest.raises(ConfigError, match="detect must be a DetectConfig"):
        FalconConfig(detect=ControlConfig())  # type: ignore[arg-type]


def test_unknown_names_and_bad_values_are_refused_by_the_concern_that_owns_them() -> None:
    with pytest.raises(ConfigError, match="unknown FalconConfig field.*min_slowness"):
        FalconConfig(min_slowness=0.1)
    with pytest.raises(ConfigError, match="unknown FalconConfig field.*detect_window"):
        FalconConfig().replace(detect_window=3)
    with pytest.raises(ConfigError, match="min_slowdown must be > 0"):
        DetectConfig(min_slowdown=0.0)
    with pytest.raises(ConfigError, match="heartbeat_s must be finite"):
        FalconConfig(heartbeat_s=float("nan"))
    with pytest.raises(ConfigError, match="mitigation_strategies"):
        MitigateConfig(mitigation_strategies="S2,S9")
    with pytest.raises(dataclasses.FrozenInstanceError):
        FalconConfig().detect.min_slowdown = 0.5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        FalconConfig().min_slowdown = 0.5  # type: ignore[misc]


def test_a_job_without_loop_hooks_has_mitigation_off() -> None:
    assert FalconConfig().mitigation is True
    assert FalconConfig(loop_hooks=False).mitigation is False
    assert FalconConfig(loop_hooks=False, mitigation=True).mitigate.mitigation is False


def test_flags_stay_flat_grouped_by_concern() -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    titles = [g.title for g in parser._action_groups if g.title and g.title.startswith("falcon thresholds")]
    assert len(titles) == len(CONCERNS)
    args = parser.parse_args(["--falcon-min-slowdown", "0.25", "--falcon-p2p-bytes", "4096",
                              "--falcon-mitigation", "off"])
    cfg = config_from_args(args)
    assert (cfg.detect.min_slowdown, cfg.validate.p2p_bytes, cfg.mitigate.mitigation) == (0.25, 4096, False)
    assert config_from_args(parser.parse_args([])) == FalconConfig()


def test_runtime_settability_is_read_from_the_fields_of_every_concern() -> None:
    settable = runtime_settable()
    assert "min_slowdown" in settable and "suspicious_factor" in settable and "mitigation" in settable
    assert "heartbeat_s" not in settable and "bocd_hazard" not in settable
    assert settable == {f.name for f in threshold_fields() if f.metadata.get("runtime_settable")}


def test_detection_takes_its_own_concern_and_reads_nothing_else() -> None:
    cfg = FalconConfig(min_duration=13)
    assert detect_config(cfg) is cfg.detect and detect_config(None) == DetectConfig()
    assert VerifiedBOCD(cfg).cfg is cfg.detect
    assert VerifiedBOCD(DetectConfig(min_duration=13)).cfg == cfg.detect
    with pytest.raises(ConfigError, match="expected a FalconConfig or DetectConfig"):
        detect_config(ControlConfig())  # type: ignore[arg-type]
