"""A real Prometheus server for the tests (Debian's package ``prometheus``, 2.42 here):
started on a free loopback port with a scrape config for one target, queried over its
HTTP API, stopped at the end (its data folder stays with the test's other files)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from falconext.ports import free_port

BINARY = shutil.which("prometheus")
WHY_NOT = None if BINARY else "Prometheus is not installed (Debian package prometheus)"
#: the scrape job's name: the dashboard's ``$job`` variable is this job's label
JOB = "falconext"


class Prometheus:
    """``prometheus`` scraping ``127.0.0.1:target_port`` every second; ready when built
    (within ``timeout`` seconds, or a RuntimeError naming its log's last line)."""

    def __init__(self, folder: Path, target_port: int, timeout: float = 30.0) -> None:
        assert BINARY is not None, WHY_NOT
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        config = folder / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
                          f"  - job_name: {JOB}\n    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n")
        self.log = folder / "prometheus.log"
        self.proc = subprocess.Popen(
            [BINARY, f"--config.file={config}", f"--storage.tsdb.path={folder / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=self.log.open("w"))
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                raise RuntimeError(f"prometheus did not start: {tail[0]}")
            time.sleep(0.2)

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        """The series ``expr`` returns over ``[start, end]`` (``/api/v1/query_range``):
        each ``{"metric": labels, "values": [[t, "v"], ...]}``; a refused query raises."""
        qs = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/query_range?{qs}", timeout=30) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{expr}: {body.get('error')}")
        return body["data"]["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
