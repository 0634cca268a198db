"""The dashboard in a real headless browser (Debian's chromium) against a live server under load: the
page loads, all ten panels draw data, the console stays quiet, and a screenshot is kept.

Chromium is installed with apt-get when missing; the test skips (saying why) only where it cannot be."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.server.conftest import RunningServer, run_server
from tokenmill.server.config import ServerConfig

pytestmark = pytest.mark.browser
PANELS = ("throughput", "phases", "batch", "memory", "latency", "queue", "device", "errors", "scaling", "cost")


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    try:
        subprocess.run(["apt-get", "update"], check=True, capture_output=True, timeout=300)
        subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
            check=True,
            capture_output=True,
            timeout=600,
            env={"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"chromium is not installed and apt-get could not install it: {exc}")
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("apt-get ran but no chromium binary appeared")
    return path


class PanelParser(HTMLParser):
    """Each panel's data-points / data-max attributes and the body's data-updates from a dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.panels: dict[str, dict[str, str]] = {}
        self.body: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "section" and "panel" in a.get("class", ""):
            self.panels[a["id"]] = a
        elif tag == "body":
            self.body = a


@pytest.fixture(scope="module")
def loaded_server(chat_model: Path) -> Iterator[RunningServer]:
    """A server with a steady stream of requests (and a few bad ones) running in the background."""
    config = ServerConfig(slo_ttft_ms=200, slo_itl_ms=50, cost_per_hour=1.5)
    with run_server(chat_model, config, engine_process=True) as running:
        stop = threading.Event()

        def load() -> None:
            with running.client() as client:
                while not stop.is_set():
                    client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 24, "ignore_eos": True})
                    client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})  # a validation error

        workers = [threading.Thread(target=load, daemon=True) for _ in range(3)]
        for w in workers:
            w.start()
        time.sleep(4)  # a few seconds of history before the page opens
        try:
            yield running
        finally:
            stop.set()
            for w in workers:
                w.join(30)


def run_chromium(chromium: str, args: list[str], url: str) -> subprocess.CompletedProcess[str]:
    common = ["--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0"]
    return subprocess.run(
        [chromium, *common, "--window-size=1500,2000", "--virtual-time-budget=6000", *args, url],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ten_panels_draw_live_data_in_chromium(loaded_server: RunningServer, tmp_path: Path) -> None:
    chromium = find_chromium()
    url = f"{loaded_server.url}/dashboard"
    dom = run_chromium(chromium, ["--dump-dom"], url)
    parser = PanelParser()
    parser.feed(dom.stdout)
    assert set(parser.panels) == set(PANELS), dom.stderr[-2000:]
    assert int(parser.body.get("data-updates", "0")) >= 2, "the page did not refresh from /dashboard/data"
    for name in PANELS:
        panel = parser.panels[name]
        assert int(panel.get("data-points", "0")) > 0, f"panel {name} drew no points"
    # Every panel shows something above zero under load (errors are provoked; scaling is 1 replica).
    for name in PANELS:
        assert float(parser.panels[name].get("data-max", "0")) > 0, f"panel {name} shows only zeros"
    console = [line for line in dom.stderr.splitlines() if re.search(r"CONSOLE|Uncaught", line)]
    assert console == [], console

    shot = tmp_path / "dashboard.png"
    run_chromium(chromium, [f"--screenshot={shot}"], url)
    assert shot.exists() and shot.stat().st_size > 20_000
    print(f"dashboard screenshot: {shot}")
