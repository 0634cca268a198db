"""Start-up time (issue 48): how long tokenmill takes to be useful, each figure over repeated fresh processes.

Usage: .venv/bin/python bench/scripts/startup.py [--repeat 5] [--only serve,llm,qwen-dummy] [--fresh-clone]
           [--timeout 300] [--output bench/results/xeon-amx/startup.json]

- serve: `tokenmill serve` (the embedded model, a free port) from launch to the first 200 from /health, then
  one chat completion (max_tokens 8); the server's `start-up` phase lines, where it prints them, are kept.
- llm: a fresh `python -c` process running `from tokenmill import LLM, SamplingParams` and
  `LLM().generate([...], SamplingParams(max_tokens=8))`: the process's wall time, and as the child times
  them, the import and LLM() + generate.
- qwen-dummy: the same two for the qwen2.5-0.5b preset with dummy weights (--load-format dummy): serve to
  /health (no chat: a preset has no tokenizer) and LLM() + generate on token ids.
- --fresh-clone (once, slow): a `git clone` of this repo into a temporary folder with empty kernel and
  tokenmill caches, then README command 1 (`bash scripts/setup.sh && .venv/bin/tokenmill serve --port P`, its
  two halves timed apart) until /health answers, then a first chat request; which kernels setup.sh, the serve's
  start and the request built (libraries new in the caches). pip's own cache and local wheels stay warm.

Every figure is the median of the runs that succeeded, with all values and its target beside it; a run that
fails (a server not healthy within --timeout, a child that exits non-zero) is recorded, never waited on forever.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TOKENMILL = str(Path(PYTHON).with_name("tokenmill"))
KINDS = ("serve", "llm", "qwen-dummy")
QWEN = ["qwen2.5-0.5b", "--load-format", "dummy"]
# Issue 48's targets, in seconds.
TARGETS = {"serve": 3.0, "llm": 2.0, "qwen-dummy": 5.0, "fresh-clone": 120.0}
# Where the C++ kernels are cached (tokenmill/ops/kernel_cache.py), and torch's build folder for any
# extension tokenmill leaves to torch: both empty in a fresh clone.
KERNEL_CACHE_ENVS = ("TOKENMILL_KERNEL_CACHE", "TORCH_EXTENSIONS_DIR")
SETUP_TIMEOUT_S = 1800.0  # pip, then the kernels' compile at install
PHASE_LINE = re.compile(r"start-up", re.IGNORECASE)  # the server's phase lines, not uvicorn's "startup"
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}

# The child of `llm` and `qwen-dummy`: argv[1] is the JSON [args, kwargs, prompts] of LLM() and generate().
CHILD = """
import json, sys, time
start = time.perf_counter()
from tokenmill import LLM, SamplingParams
imported = time.perf_counter()
args, kwargs, prompts = json.loads(sys.argv[1])
LLM(*args, **kwargs).generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
done = time.perf_counter()
print("STARTUP " + json.dumps({"import_s": imported - start, "llm_and_generate_s": done - imported}))
"""


def figure(values: list[float], target: float | None = None) -> dict[str, Any]:
    """The median of `values` (None when every run failed), all of them, and the target it is held to."""
    median = statistics.median(values) if values else None
    out: dict[str, Any] = {"median": round(median, 3) if median is not None else None}
    out["values"] = [round(v, 3) for v in values]
    if target is not None:
        out["target_max"] = target
        out["meets_target"] = median is not None and median <= target
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM (the server drains), then SIGKILL for whatever of its session is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def wait_health(url: str, proc: subprocess.Popen[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before /health answered")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"/health did not answer 200 within {timeout_s:g} s")


def first_chat(url: str) -> dict[str, Any]:
    start = time.perf_counter()
    httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=300).raise_for_status()
    return {"first_chat_s": time.perf_counter() - start}


def serve_once(
    command: list[str], then: Callable[[str], dict[str, Any]] | None, timeout_s: float, **popen: Any
) -> dict[str, Any]:
    """One server from launch (`command` gets --port) to /health, then `then(url)`'s figures; then stopped."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **popen
        )
        run: dict[str, Any] = {}
        try:
            wait_health(url, proc, timeout_s)
            run["health_s"] = time.perf_counter() - start
            if then is not None:
                run.update(then(url))
        except (RuntimeError, httpx.HTTPError) as exc:
            run["error"] = str(exc)
        finally:
            kill_group(proc)
        log.seek(0)
        lines = log.read().splitlines()
    run["phases"] = [line for line in lines if PHASE_LINE.search(line)]
    if "error" in run:
        run["log_tail"] = lines[-20:]
    return run


def run_process(command: list[str], timeout_s: float, **popen: Any) -> tuple[int | None, list[str]]:
    """Run `command` to its end (None: killed after timeout_s); its stdout and stderr as lines."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **popen
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        return None, []
    return proc.returncode, output.splitlines()


def llm_once(request: list[Any], timeout_s: float) -> dict[str, Any]:
    """One fresh Python process: import, LLM(), an 8-token generate, exit."""
    start = time.perf_counter()
    returncode, lines = run_process([PYTHON, "-c", CHILD, json.dumps(request)], timeout_s)
    wall = time.perf_counter() - start
    reports = [line.removeprefix("STARTUP ") for line in lines if line.startswith("STARTUP ")]
    if returncode != 0 or not reports:
        return {"error": f"exited with {returncode} (None: killed after {timeout_s:g} s)", "log_tail": lines[-20:]}
    return {"process_wall_s": wall, **json.loads(reports[-1])}


def summarize(runs: list[dict[str, Any]], targets: dict[str, float]) -> dict[str, Any]:
    """Each timed key of `runs` as a figure (targets by key); phase lines and failures kept per run."""
    keys = [k for k in dict.fromkeys(k for run in runs for k in run) if k.endswith("_s")]
    out: dict[str, Any] = {k: figure([run[k] for run in runs if k in run], targets.get(k)) for k in keys}
    if any(run.get("phases") for run in runs):
        out["phases"] = [run.get("phases", []) for run in runs]
    out["errors"] = [{"run": i, **run} for i, run in enumerate(runs) if "error" in run]
    return out


def cases(kinds: list[str], timeout_s: float) -> dict[str, tuple[Callable[[], dict[str, Any]], dict[str, float]]]:
    """Each measured case of `kinds`: how to run it once, and its targets by key."""
    default_request = [[], {}, ["The capital of France is"]]
    qwen_request = [["qwen2.5-0.5b"], {"load_format": "dummy"}, [{"prompt_token_ids": list(range(100, 116))}]]
    every = {
        "serve": (lambda: serve_once([TOKENMILL, "serve"], first_chat, timeout_s), {"health_s": TARGETS["serve"]}),
        "llm": (lambda: llm_once(default_request, timeout_s), {"llm_and_generate_s": TARGETS["llm"]}),
        "qwen_dummy_serve": (
            lambda: serve_once([TOKENMILL, "serve", *QWEN], None, timeout_s),
            {"health_s": TARGETS["qwen-dummy"]},
        ),
        "qwen_dummy_llm": (lambda: llm_once(qwen_request, timeout_s), {"llm_and_generate_s": TARGETS["qwen-dummy"]}),
    }
    return {name: case for name, case in every.items() if name.startswith(tuple(k.replace("-", "_") for k in kinds))}


def measure(kinds: list[str], repeat: int, timeout_s: float) -> dict[str, Any]:
    """Each case `repeat` times, the cases taking turns so that a drifting machine hits them alike."""
    chosen = cases(kinds, timeout_s)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    for i in range(repeat):
        for name, (run_once, _) in chosen.items():
            print(f"run {i + 1}/{repeat}: {name}", flush=True)
            runs[name].append(run_once())
    return {name: summarize(runs[name], targets) for name, (_, targets) in chosen.items()}


def cache_files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def compiled(files: set[str]) -> list[str]:
    return sorted(name for name in files if name.endswith((".so", ".o")))


def fresh_env(caches: Path) -> dict[str, str]:
    """This environment without its venv, and with empty kernel and tokenmill caches under `caches`."""
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if Path(p) != Path(PYTHON).parent)
    env |= {name: str(caches / name.lower()) for name in KERNEL_CACHE_ENVS}
    env["TOKENMILL_CACHE"] = str(caches / "tokenmill")
    return env


def fresh_clone(timeout_s: float) -> dict[str, Any]:
    """README command 1 in a fresh clone with empty caches; pip's cache and local wheels stay as they are."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-fresh-") as tmp:
        repo, caches = Path(tmp) / "tokenmill", Path(tmp) / "caches"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
        env = fresh_env(caches)
        out: dict[str, Any] = {
            "commit": git(["rev-parse", "--short", "HEAD"], repo),
            "pip_cache": f"warm: ~/.cache/pip and PIP_FIND_LINKS={os.environ.get('PIP_FIND_LINKS')} as they were",
        }
        start = time.perf_counter()
        returncode, lines = run_process(["bash", "scripts/setup.sh"], SETUP_TIMEOUT_S, cwd=repo, env=env)
        out["setup_s"] = round(time.perf_counter() - start, 1)
        if returncode != 0:
            return {**out, "error": f"setup.sh exited with {returncode}", "log_tail": lines[-20:]}
        out["venv_mb"] = int(
            subprocess.run(["du", "-sm", ".venv"], cwd=repo, capture_output=True, text=True).stdout.split()[0]
        )
        after_setup = cache_files(caches)
        out["kernels_built_by_setup"] = compiled(after_setup)

        def chat_compiles_nothing(url: str) -> dict[str, Any]:
            before = cache_files(caches)
            timing = first_chat(url)
            new = cache_files(caches) - before
            return {
                "kernels_built_by_serve_start": compiled(before - after_setup),
                **timing,
                "files_new_in_caches_during_chat": sorted(new),
                "chat_compiled_nothing": not compiled(new),
            }

        serve = serve_once([".venv/bin/tokenmill", "serve"], chat_compiles_nothing, timeout_s, cwd=repo, env=env)
        out |= {k: round(v, 1) if k.endswith("_s") else v for k, v in serve.items()}
        if "health_s" in serve:
            out["total_s"] = round(out["setup_s"] + serve["health_s"], 1)
            out["total_s_target_max"] = TARGETS["fresh-clone"]
            out["meets_target"] = out["total_s"] <= TARGETS["fresh-clone"]
        return out


def git(args: list[str], cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True).stdout.strip()


def hardware() -> Any:
    """`tokenmill info --json`: the CPU, its instruction sets and the kernel paths tokenmill takes there."""
    returncode, lines = run_process([TOKENMILL, "info", "--json"], 120)
    return json.loads("\n".join(lines)) if returncode == 0 else {"error": lines[-5:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes per figure")
    parser.add_argument("--only", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--fresh-clone", action="store_true", help="also time a fresh clone's README command 1")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a start may take before it fails")
    parser.add_argument("--output", default="bench/results/xeon-amx/startup.json")
    args = parser.parse_args()
    kinds = [k for k in args.only.split(",") if k]
    if set(kinds) - set(KINDS):
        parser.error(f"--only takes {', '.join(KINDS)}, not {args.only!r}")
    result: dict[str, Any] = {
        "benchmark": "startup",
        "command": " ".join(["python", "bench/scripts/startup.py", *sys.argv[1:]]),
        "commit": git(["rev-parse", "--short", "HEAD"]),
        "tree_clean": not git(["status", "--porcelain", "--untracked-files=no"]),
        "hardware": hardware(),
        "repeat": args.repeat,
        **measure(kinds, args.repeat, args.timeout),
    }
    if args.fresh_clone:
        result["fresh_clone"] = fresh_clone(args.timeout)
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
