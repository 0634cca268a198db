"""What every peer engine shares: where its virtualenv lives, how it is built (idempotent setup steps), and how
its driver runs in a subprocess with that virtualenv's Python (peer_protocol.py is the contract).

A peer's folder, `$TOKENMILL_CACHE/peers/NAME` (default `~/.cache/tokenmill/peers/NAME`):

    venv/          the peer's own virtualenv (its pins never touch tokenmill's)
    setup.json     written last by a successful `tokenmill bench setup-peer NAME`: versions, seconds, size
    weights/       converted copies of HF folders (GGUF files, CTranslate2 folders), made on first use
    logs/          each driver run's stdout and stderr
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.bench.peers.drivers.peer_protocol import PeerRequest, PeerResult

DRIVERS_DIR = Path(__file__).parent / "drivers"
# The CPU wheel of the torch that tokenmill itself pins; peers that need torch get this one.
TORCH_REQUIREMENT = "torch==2.13.0"


@dataclass(frozen=True)
class SetupStep:
    """One idempotent step: skipped when `check` (a Python snippet run in the peer's venv) succeeds."""

    description: str
    command: list[str]  # "{python}" and "{root}" are replaced by the venv's Python and the peer's folder
    check: str | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PeerSpec:
    """A peer engine: how to build its environment, which driver runs it, which precisions it has."""

    name: str
    description: str
    driver: str  # file name in drivers/
    version_module: str  # imported in the venv to report the version (`module.__version__`)
    dtypes: tuple[str, ...]
    setup_steps: Callable[[Path], list[SetupStep]]
    # (peer folder, HF folder, dtype) -> converted weights, or None when the driver reads the HF folder
    prepare_weights: Callable[[Path, Path, str], Path | None] = lambda root, model, dtype: None
    driver_env: Callable[[int], dict[str, str]] = lambda threads: {}
    # (peer folder) -> what the driver needs beyond isa.AVX2_ENV to run as on an AVX2-only CPU (may build once)
    avx2_env: Callable[[Path], dict[str, str]] = lambda root: {}


def peers_dir() -> Path:
    from tokenmill.loader.default_model import cache_dir  # imports torch: only when a path is needed

    return cache_dir() / "peers"


def peer_root(name: str) -> Path:
    return peers_dir() / name


def venv_python(root: Path) -> Path:
    return root / "venv" / "bin" / "python"


def is_set_up(name: str) -> bool:
    root = peer_root(name)
    return (root / "setup.json").is_file() and venv_python(root).is_file()


def not_set_up_note(name: str) -> str:
    failed = peer_root(name) / "setup-failed.json"
    why = ""
    if failed.is_file():
        why = f" (its last setup failed: {json.loads(failed.read_text()).get('error', '?')[:300]})"
    return f"{name} is not set up{why}; run `tokenmill bench setup-peer {name}`"


def setup_peer(spec: PeerSpec, force: bool = False, log: Callable[[str], None] = print) -> dict:
    """Build the peer's virtualenv step by step (steps already done are skipped; `force` starts afresh) and
    record it in setup.json. Raises RuntimeError, after writing setup-failed.json, if a step fails."""
    root = peer_root(spec.name)
    if force and root.exists():
        shutil.rmtree(root / "venv", ignore_errors=True)
        (root / "setup.json").unlink(missing_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    python = venv_python(root)
    started = time.perf_counter()
    steps: list[dict] = []
    try:
        if not python.is_file():
            log(f"[{spec.name}] creating a virtualenv in {root / 'venv'}")
            _run([sys.executable, "-m", "venv", str(root / "venv")], {}, root / "setup.log")
        for step in spec.setup_steps(root):
            steps.append(_run_step(step, python, root, log, spec.name))
        version = _venv_version(python, spec.version_module)
    except RuntimeError as exc:
        (root / "setup-failed.json").write_text(json.dumps({"error": str(exc), "steps": steps}, indent=2))
        raise
    (root / "setup-failed.json").unlink(missing_ok=True)
    record = {
        "name": spec.name,
        "version": version,
        "python": str(python),
        "seconds": round(time.perf_counter() - started),
        "size_bytes": _folder_size(root / "venv"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "steps": steps,
    }
    (root / "setup.json").write_text(json.dumps(record, indent=2))
    return record


def _run_step(step: SetupStep, python: Path, root: Path, log: Callable[[str], None], name: str) -> dict:
    if step.check and subprocess.run([str(python), "-c", step.check], capture_output=True, check=False).returncode == 0:
        log(f"[{name}] {step.description}: already done")
        return {"step": step.description, "skipped": True}
    command = [c.replace("{python}", str(python)).replace("{root}", str(root)) for c in step.command]
    log(f"[{name}] {step.description}: {' '.join(command)}")
    started = time.perf_counter()
    _run(command, step.env, root / "setup.log")
    return {"step": step.description, "seconds": round(time.perf_counter() - started, 1)}


def _run(command: list[str], env: dict[str, str], log_path: Path) -> None:
    with open(log_path, "a") as log_file:
        log_file.write(f"\n$ {' '.join(command)}\n")
        log_file.flush()
        proc = subprocess.run(
            command, env={**os.environ, **env}, stdout=log_file, stderr=subprocess.STDOUT, check=False
        )
    if proc.returncode != 0:
        tail = log_path.read_text()[-2000:]
        raise RuntimeError(f"`{' '.join(command)}` exited with {proc.returncode}; end of {log_path}:\n{tail}")


def _venv_version(python: Path, module: str) -> str:
    code = f"import {module}; print({module}.__version__)"
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"`import {module}` fails in {python}:\n{proc.stderr[-2000:]}")
    return proc.stdout.strip().splitlines()[-1]


def _folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def converted_weights(
    root: Path, model: Path, name: str, convert: Callable[[Path], None], log: Callable[[str], None] = print
) -> Path:
    """`root/weights/<model>-<key>/<name>`, made once by `convert(tmp_path)` and then renamed into place (so a
    crash leaves no half-written file that looks finished). The key changes when the model's files change."""
    stats = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model.iterdir() if p.is_file())
    key = hashlib.sha256(f"{model.resolve()}:{stats}".encode()).hexdigest()[:12]
    target = root / "weights" / f"{model.name}-{key}" / name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{name}.tmp-{os.getpid()}")
    log(f"converting {model} for {root.name} into {target} (once)")
    started = time.perf_counter()
    convert(tmp)
    tmp.rename(target)
    log(f"converted in {time.perf_counter() - started:.0f} s")
    return target


def run_driver(
    name: str,
    python: str | Path,
    driver: str,
    request: PeerRequest,
    *,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    log_dir: Path | None = None,
) -> PeerResult:
    """Run `drivers/<driver>` with `python` on `request` in a subprocess and read its result. Never raises for
    an engine failure: a crash, a timeout or a missing result comes back as a PeerResult with `error` set."""
    log_dir = log_dir or peers_dir() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    with tempfile.TemporaryDirectory(prefix=f"tokenmill-{name}-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(request.to_json())
        command = [str(python), str(DRIVERS_DIR / driver), str(request_path), str(result_path)]
        with open(log_path, "w") as log_file:
            try:
                subprocess.run(
                    command,
                    env={**os.environ, **(env or {})},
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    timeout=timeout_s,
                    cwd=tmp,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                return PeerResult(engine=name, error=f"timed out after {timeout_s:.0f} s; log: {log_path}")
        if not result_path.is_file():
            tail = log_path.read_text()[-3000:]
            return PeerResult(engine=name, error=f"the driver wrote no result; end of {log_path}:\n{tail}")
        return PeerResult.from_json(result_path.read_text())
