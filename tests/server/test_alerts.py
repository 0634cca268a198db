"""deploy/prometheus/alerts.yml: promtool accepts the rules and their unit tests (alerts_test.yml) pass,
every alert has a severity and a runbook section, and the rules name only metrics tokenmill exports.

promtool comes from Debian's prometheus package, downloaded and unpacked (no root install) into
~/.cache/tokenmill/promtool; the test skips, saying why, only where it cannot be had."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tokenmill.metrics.grafana import RULES, exported_names, recorded_names

pytestmark = pytest.mark.promtool
RUNBOOK = Path(__file__).parents[2] / "docs" / "runbook.md"
CACHE = Path.home() / ".cache" / "tokenmill" / "promtool"


def promtool() -> str:
    if found := shutil.which("promtool"):
        return found
    binary = CACHE / "usr" / "bin" / "promtool"
    if binary.exists():
        return str(binary)
    CACHE.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["apt-get", "update"], capture_output=True, timeout=300, check=True)
        subprocess.run(["apt-get", "download", "prometheus"], cwd=CACHE, capture_output=True, timeout=300, check=True)
        deb = next(CACHE.glob("prometheus_*.deb"))
        subprocess.run(["dpkg", "-x", str(deb), str(CACHE)], capture_output=True, timeout=300, check=True)
        deb.unlink()
    except (OSError, subprocess.SubprocessError, StopIteration) as exc:
        pytest.skip(f"promtool is not installed and Debian's prometheus package could not be fetched: {exc}")
    return str(binary)


def alerts() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the `## ` headings."""
    return {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^## (.+)$", markdown, re.M)}


def test_promtool_checks_the_rules_and_runs_their_tests() -> None:
    tool = promtool()
    check = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run(
        [tool, "test", "rules", "alerts_test.yml"], cwd=RULES.parent, capture_output=True, text=True, timeout=120
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr


def test_every_alert_has_a_severity_and_a_runbook_section() -> None:
    sections = anchors(RUNBOOK.read_text())
    names = [rule["alert"] for rule in alerts()]
    assert len(names) == len(set(names)) >= 9
    for rule in alerts():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        page, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert page == "docs/runbook.md" and anchor in sections, rule["alert"]


def test_throughput_alerts_are_tiered_at_70_and_50_percent() -> None:
    by_name = {rule["alert"]: rule for rule in alerts()}
    warning, critical = by_name["TokenmillThroughputBelowBaseline"], by_name["TokenmillThroughputFarBelowBaseline"]
    assert "< 0.7 * tokenmill:throughput_toks_per_s:baseline" in warning["expr"]
    assert "< 0.5 * tokenmill:throughput_toks_per_s:baseline" in critical["expr"]
    assert (warning["for"], warning["labels"]["severity"]) == ("5m", "warning")
    assert (critical["for"], critical["labels"]["severity"]) == ("5m", "critical")


def test_rules_name_only_exported_or_recorded_metrics() -> None:
    known = exported_names() | recorded_names()
    named = set(re.findall(r"\btokenmill:[A-Za-z0-9_:]+", RULES.read_text()))
    assert named and named <= known, named - known
