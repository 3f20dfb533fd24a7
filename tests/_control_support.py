"""Helpers for the control tests: real training processes and raw HTTP to them."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _zygote as zygote
from hookloop.callbacks import read_jsonl
from hookloop.control.registry import JobRecord

JOB_SCRIPT = Path(__file__).with_name("_control_job.py")
START_S = 90.0  # starting python + torch on a loaded, shared 2-core machine is slow
WAIT_S = 30.0


class Job:
    """One ``tests/_control_job.py`` process registered under ``jobs_dir`` (started from a
    zygote that has imported torch and hookloop already: tests/_zygote.py)."""

    def __init__(
        self, root: Path, jobs_dir: Path, job_id: str, *overrides: str, sleep: float = 0.005
    ) -> None:
        self.root = root
        self.out = root / "run"
        self.jobs_dir = jobs_dir
        self.job_id = job_id
        self.stderr_path = root / "stderr.txt"
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env.update(
            HOOKLOOP_JOBS_DIR=str(jobs_dir),
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            PYTHONDONTWRITEBYTECODE="1",
        )
        root.mkdir(parents=True, exist_ok=True)
        with self.stderr_path.open("w") as stderr:
            command = [sys.executable, str(JOB_SCRIPT), str(self.out), job_id]
            self.proc = zygote.Popen(
                [*command, "--sleep", str(sleep), *overrides],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=env,
            )
        self.record: JobRecord | None = None
        self.token = ""

    # -- lifecycle
    def ready(self, timeout: float = START_S) -> Job:
        """Wait for endpoint.json; returns self."""
        if self.record is not None:
            return self
        job_dir = self.jobs_dir / self.job_id
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"job {self.job_id} exited with {self.proc.returncode} before serving:\n"
                    + self.stderr()
                )
            if (job_dir / "endpoint.json").is_file():
                try:
                    self.record = JobRecord.load(job_dir)
                    self.token = self.record.read_token()
                    return self
                except (ValueError, OSError):
                    pass  # being written
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"job {self.job_id} did not serve within {timeout:.0f} s")

    def wait_exit(self, timeout: float = WAIT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job {self.job_id} still running after {timeout:.0f} s") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=WAIT_S)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    # -- HTTP
    @property
    def port(self) -> int:
        assert self.record is not None
        return self.record.port

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        token: str | None = None,
        headers: dict[str, str] | None = None,
        conn: http.client.HTTPConnection | None = None,
    ) -> tuple[int, Any, dict[str, str]]:
        """``(status, JSON or text, headers)``; ``token=None`` sends this job's token."""
        own = conn is None
        conn = conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=WAIT_S)
        hdrs = dict(headers or {})
        if token is None:
            hdrs.setdefault("Authorization", f"Bearer {self.token}")
        elif token:
            hdrs["Authorization"] = token
        try:
            conn.request(method, path, body=body, headers=hdrs)
            response = conn.getresponse()
            raw = response.read()
            status, got = response.status, dict(response.getheaders())
        finally:
            if own:
                conn.close()
        try:
            decoded = json.loads(raw) if raw else None
        except ValueError:
            decoded = raw.decode("utf-8", "replace")
        return status, decoded, got

    def api(self, route: str) -> str:
        return f"/jobs/{self.job_id}/{route}"

    def status(self) -> dict[str, Any]:
        code, body, _ = self.request("GET", self.api("status"))
        assert code == 200, (code, body)
        return body

    def command(self, name: str, values: dict[str, Any] | None = None) -> dict[str, Any]:
        asked = {"command": name} if values is None else {"command": name, "values": values}
        code, body, _ = self.request(
            "POST",
            self.api("control"),
            json.dumps(asked).encode(),
            headers={"Content-Type": "application/json"},
        )
        # Forgather's acknowledgement: 200 {"status": "acknowledged", "command": name, ...}
        assert code == 200 and body["status"] == "acknowledged", (code, body)
        assert body["command"] == name, body
        return body

    def wait_for(self, what: str, predicate: Any, timeout: float = WAIT_S) -> Any:
        """Poll ``predicate()`` until it returns something truthy."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"job {self.job_id} exited ({self.proc.returncode}) waiting for {what}:\n"
                    + self.stderr()
                )
            time.sleep(0.05)
        raise AssertionError(f"job {self.job_id}: no {what} within {timeout:.0f} s")

    def wait_step(self, step: int) -> int:
        return self.wait_for(f"step {step}", lambda: (s := self.status()["step"]) >= step and s)

    def checkpoints(self) -> dict[str, int]:
        """Complete checkpoint directories and the step each manifest records."""
        root = self.out / "checkpoints"
        found = {}
        for path in sorted(root.glob("step-*")) if root.is_dir() else []:
            manifest = path / "manifest.json"
            if manifest.is_file():
                found[path.name] = json.loads(manifest.read_text())["step"]
        return found

    def records(self, kind: str) -> list[dict[str, Any]]:
        path = self.out / "metrics.jsonl"
        return [r for r in read_jsonl(path) if r.get("kind") == kind] if path.is_file() else []


def train_in_background(trainer: Any, outcome: dict[str, Any] | None = None) -> tuple[Any, dict]:
    """Run ``trainer.train()`` on a daemon thread; its result or error lands in ``outcome``."""
    import threading

    outcome = {} if outcome is None else outcome

    def run() -> None:
        try:
            outcome["result"] = trainer.train()
        except BaseException as err:  # reported to the test
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome
