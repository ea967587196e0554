"""GPU health snapshot from NVML, to explain a slow-GPU verdict.

A GEMM benchmark says a GPU is slow, not why; clocks below their maximum together with
the throttle reasons (thermal, power cap, hardware slowdown) tell a cooling or power
problem from a faulty part. This is evidence for the report, never a verdict, so it must
not fail validation: without NVML (no GPU, no driver) it returns [], and a field a
device does not support is None.
"""

from __future__ import annotations

from typing import Any, Callable

# NVML clocks-throttle (a.k.a. clocks-event) reason bits; fixed by the NVML ABI, spelled
# out so decoding does not depend on which names a given nvidia-ml-py release exports.
THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}


def decode_throttle_reasons(mask: int) -> list[str]:
    """Names of the set reason bits, lowest bit first; unknown bits as 'bit_0x...'."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_REASONS)
    bit = 1
    while rest >= bit:
        if rest & bit:
            names.append(f"bit_{bit:#x}")
        bit <<= 1
    return names


def gpu_health() -> list[dict[str, Any]]:
    """One dict per visible GPU: clocks, temperature, power, throttle reasons, utilization."""
    try:
        import pynvml  # lazy: optional dependency (pynvml, nvidia-ml-py)
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        return [_device(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _device(nv, index: int) -> dict[str, Any]:
    h = nv.nvmlDeviceGetHandleByIndex(index)

    def get(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception:  # NVMLError_NotSupported and friends: leave the field empty
            return None

    name = get(lambda: nv.nvmlDeviceGetName(h))
    power_mw = get(lambda: nv.nvmlDeviceGetPowerUsage(h))
    limit_mw = get(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h))
    reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
    mask = get(lambda: reasons(h))
    util = get(lambda: nv.nvmlDeviceGetUtilizationRates(h))
    return {
        "index": index,
        "name": name.decode() if isinstance(name, bytes) else name,
        "sm_clock_mhz": get(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
        "max_sm_clock_mhz": get(lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)),
        "temperature_c": get(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
        "power_w": None if power_mw is None else power_mw / 1000.0,
        "power_limit_w": None if limit_mw is None else limit_mw / 1000.0,
        "throttle_reasons": None if mask is None else decode_throttle_reasons(int(mask)),
        "utilization_gpu_pct": None if util is None else util.gpu,
        "utilization_memory_pct": None if util is None else util.memory,
    }
