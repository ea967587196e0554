"""S4: checkpoint, restart without the bad node, resume exactly where the job stopped.

Each rank saves its own shard (its pipeline stage's model, its optimizer state, its
RNG states) plus the loop position, at an iteration boundary every rank agreed on in a
suspension. Files are written to a temporary name and renamed, so a crash mid-save
never leaves a half checkpoint that a resume would trust; they are read back with
``torch.load(weights_only=True)``, which rebuilds tensors and plain containers and
nothing else. The data order is defined per global batch (megatron/data.py), so the
loop position is all the data loader needs.

The restart itself is the launcher's: the ranks write ``restart.json`` (what to
exclude, where to resume) and exit 0 (torchrun folds rank exit codes into one, so a
file is the message; the launcher treats "exit 0 and a fresh restart.json" as
"restart", :data:`RESTART_FILE`). On the CPU test bed a virtual node is "replaced" by
dropping the faults that concern it; on a cluster the launcher maps the excluded node
to a spare (or shrinks the job by one DP replica) before calling torchrun again.
"""

from __future__ import annotations

import io
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

# torch and numpy are imported where a checkpoint is made or read: the launcher reads
# restart requests with this module before anything else needs torch


RESTART_FILE = "restart.json"
#: the launcher's wall clock when it started torchrun: a rank's start-up, part of S4's
#: cost, is measured from it (after a restart, from the restart request)
LAUNCH_TIME_ENV = "FALCON_LAUNCH_TIME"
CHECKPOINT_DIR = "checkpoint"
FORMAT = 1


@dataclass(frozen=True)
class RestartRequest:
    """What the ranks ask the launcher to do: resume at ``iteration`` without ``exclude_nodes``."""

    iteration: int
    exclude_nodes: list[int]
    checkpoint: str
    session: int = 0
    requested_at: float = 0.0
    save_s: float = 0.0
    attempt: int = 1
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class CheckpointError(ValueError):
    """A checkpoint or restart request that is missing, malformed, or for another layout."""


def shard_path(directory: str, rank: int) -> str:
    """The checkpoint shard of ``rank`` in ``directory`` (``rankNNNNN.pt``)."""
    return os.path.join(directory, f"rank{rank:05d}.pt")


def rng_state() -> dict[str, Any]:
    """Every random generator's state of this process (torch, Python, numpy, and CUDA when
    initialised), as tensors and plain values that a weights-only load accepts."""

    # lazy: start-up time (the launchers read restart requests here: no torch in them)
    import numpy as np
    import torch

    state = {
        "torch": torch.get_rng_state(),
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        # numpy's state as a tensor and plain numbers: weights_only loading refuses numpy arrays
        "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
        "numpy_pos": int(np.random.get_state()[2]),
        "numpy_gauss": [int(np.random.get_state()[3]), float(np.random.get_state()[4])],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the generators from :func:`rng_state`'s dict, so the next draws equal those
    the saving process would have made (CUDA only where CUDA is available)."""

    # lazy: start-up time (the launchers read restart requests here: no torch in them)
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(v) for v in internal), gauss))
    has_gauss, cached = state["numpy_gauss"]
    keys = state["numpy"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, int(state["numpy_pos"]), int(has_gauss), float(cached)))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def state_payload(rank: int, layout: dict[str, int], iteration: int, model: Any, optimizer: Any,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything a role needs to go on exactly where it stopped: one format for the
    disk shard (S4) and the in-memory hand-over of a topology switch (S3)."""
    return {
        "format": FORMAT,
        "rank": rank,
        "layout": dict(layout),
        "iteration": int(iteration),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": rng_state(),
        "extra": dict(extra or {}),
    }


def check_payload(payload: Any, where: str, rank: int, layout: dict[str, int], kind: str = "checkpoint shard",
                  verb: str = "resume") -> None:
    """CheckpointError unless ``payload`` is a state of this format, for ``rank`` and ``layout``."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a falconext {kind} of format {FORMAT}")
    if payload.get("rank") != rank or payload.get("layout") != dict(layout):
        raise CheckpointError(
            f"{where}: saved by rank {payload.get('rank')} with layout {payload.get('layout')}, "
            f"cannot {verb} rank {rank} with layout {dict(layout)}"
        )


def restore_payload(payload: Any, where: str, rank: int, layout: dict[str, int], model: Any,
                    optimizer: Any, kind: str = "checkpoint shard", verb: str = "resume") -> dict[str, Any]:
    """Load a payload made by :func:`state_payload` for ``rank``; returns iteration and extra."""
    check_payload(payload, where, rank, layout, kind, verb)
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    set_rng_state(payload["rng"])
    return {"iteration": int(payload["iteration"]), "extra": payload.get("extra", {})}


def payload_to_bytes(payload: dict[str, Any]) -> bytes:
    """``payload`` serialised by ``torch.save`` into bytes (read back with :func:`payload_from_bytes`)."""

    import torch  # lazy: start-up time (the launchers read restart requests here: no torch in them)

    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


def payload_from_bytes(data: bytes, where: str) -> Any:
    """The same strict reader as for files: tensors and plain containers only."""
    return _load(io.BytesIO(data), where, "state")


def save_shard(directory: str, rank: int, layout: dict[str, int], iteration: int, model: Any, optimizer: Any,
               extra: dict[str, Any] | None = None) -> float:
    """Write this rank's shard; returns the seconds it took."""
    import torch  # lazy: start-up time (the launchers read restart requests here: no torch in them)

    t0 = time.perf_counter()
    os.makedirs(directory, exist_ok=True)
    payload = state_payload(rank, layout, iteration, model, optimizer, extra)
    path = shard_path(directory, rank)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return time.perf_counter() - t0


def load_shard(directory: str, rank: int, layout: dict[str, int], model: Any, optimizer: Any) -> dict[str, Any]:
    """Restore this rank's model, optimizer and RNG; returns iteration and extra."""
    path = shard_path(directory, rank)
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint shard for rank {rank} at {path}")
    return restore_payload(_read(path), path, rank, layout, model, optimizer)


def _read(path: str) -> Any:
    return _load(path, path, "checkpoint shard")


def _load(source: Any, where: str, kind: str) -> Any:
    import torch  # lazy: start-up time (the launchers read restart requests here: no torch in them)

    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{where}: unreadable {kind} ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class RestartCost:
    """S4's disk part for one rank, estimated without saving the model: ``state_bytes``
    (model and optimizer tensors) written at ``write_bps`` and read back at ``read_bps``."""

    state_bytes: int
    write_bps: float
    read_bps: float

    @property
    def save_load_s(self) -> float:
        """Seconds to write this rank's state and read it back at the measured rates."""
        return self.state_bytes / self.write_bps + self.state_bytes / self.read_bps


def state_bytes(*objs: Any) -> int:
    """Bytes of every tensor in the ``state_dict()`` of each object (a model, an optimizer),
    counted in memory: what a checkpoint of them holds, less the format's few headers."""
    total = 0
    stack: list[Any] = [o.state_dict() for o in objs]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "element_size") and hasattr(item, "numel"):
            total += int(item.numel()) * int(item.element_size())
    return total


def disk_rates(directory: str, rank: int, nbytes: int) -> tuple[float, float]:
    """(write, read) bytes/s of ``directory``, timed with a scratch file of ``nbytes``
    (written and synced, dropped from the page cache where the OS allows, read back,
    removed). Never below one byte per second."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rate-probe-rank{rank}.tmp{os.getpid()}")
    block = os.urandom(min(nbytes, 1 << 20))
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            left = nbytes
            while left > 0:
                left -= f.write(block[:left])
            f.flush()
            os.fsync(f.fileno())
        write_s = time.perf_counter() - t0
        with open(path, "rb") as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            while f.read(1 << 20):
                pass
            read_s = time.perf_counter() - t0
    finally:
        try:
            os.remove(path)
        except OSError:
            pass
    return nbytes / max(write_s, nbytes / 1e12), nbytes / max(read_s, nbytes / 1e12)


def estimate_cost(directory: str, rank: int, model: Any, optimizer: Any, probe_bytes: int) -> RestartCost:
    """S4's save-and-load time for this rank without a save nobody asked for: the state's
    bytes counted in memory, the directory's rates timed with at most ``probe_bytes``."""
    size = state_bytes(model, optimizer)
    write_bps, read_bps = disk_rates(directory, rank, max(4096, min(size, probe_bytes)))
    return RestartCost(size, write_bps, read_bps)


def write_request(out: str, req: RestartRequest) -> None:
    """Write the restart request to ``out``/restart.json atomically (a temporary file
    renamed), so a reader never sees half of it."""
    path = os.path.join(out, RESTART_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(asdict(req), f, indent=2)
    os.replace(tmp, path)


def read_request(path: str) -> RestartRequest:
    """Parse restart.json strictly: exactly the known fields, of the right types."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read the restart request ({exc})") from None
    names = set(RestartRequest.__dataclass_fields__)
    if not isinstance(obj, dict) or not {"iteration", "exclude_nodes", "checkpoint"} <= set(obj) or set(obj) - names:
        raise CheckpointError(f"{path}: expected an object with fields {sorted(names)}")
    it, nodes = obj["iteration"], obj["exclude_nodes"]
    if isinstance(it, bool) or not isinstance(it, int) or it < 0:
        raise CheckpointError(f"{path}: iteration must be an integer >= 0, got {it!r}")
    if not isinstance(nodes, list) or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in nodes):
        raise CheckpointError(f"{path}: exclude_nodes must be a list of node numbers, got {nodes!r}")
    if not isinstance(obj["checkpoint"], str):
        raise CheckpointError(f"{path}: checkpoint must be a path")
    for name, kinds in (("session", int), ("attempt", int), ("requested_at", (int, float)),
                        ("save_s", (int, float)), ("reason", str), ("extra", dict)):
        if name in obj and (isinstance(obj[name], bool) or not isinstance(obj[name], kinds)):
            raise CheckpointError(f"{path}: {name} has the wrong type ({obj[name]!r})")
    if obj.get("attempt", 1) < 1:
        raise CheckpointError(f"{path}: attempt must be >= 1, got {obj['attempt']!r}")
    return RestartRequest(**obj)


def faults_without_nodes(faults: list[dict[str, Any]], nodes: list[int], ranks_per_node: int) -> list[dict[str, Any]]:
    """The test bed's "replace the node": faults on an excluded node's GPUs or links go away."""
    gone = set(nodes)
    kept = []
    for f in faults:
        if f.get("kind") == "compute" and int(f["rank"]) // ranks_per_node in gone:
            continue
        if f.get("kind") == "link" and gone & {int(n) for n in f["nodes"]}:
            continue
        kept.append(f)
    return kept
