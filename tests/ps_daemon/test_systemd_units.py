"""systemd/: both units pass `systemd-analyze verify` (Debian's systemd package; `make test`
installs it when it may), the template is the plain unit per instance, and the units agree
with the example config, which loads and names every config key."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ps_offload.daemon.config import DaemonConfig, load_config

SYSTEMD = Path(__file__).parents[2] / "systemd"
INSTALLED = "/opt/ps-offload/bin/ps-daemon"  # where systemd/README.md installs the daemon
UNIT = "ps-daemon.service"
TEMPLATE = "ps-daemon@.service"


def _verify(tmp_path: Path, units: dict[str, str], *names: str) -> list[str]:
    """Writes `units` (name -> text) to tmp_path, runs `systemd-analyze verify` on `names`
    and returns what it said about them. ExecStart must exist to pass, so the copies run
    this venv's ps-daemon instead of /opt/ps-offload's; nothing else is changed."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is missing: install Debian's systemd package (make test does, as root)")
    ours = Path(sys.executable).parent / "ps-daemon"
    assert ours.exists(), f"{ours} is missing: pip install -e . creates it"
    for name, text in units.items():
        assert INSTALLED in text, f"{name} does not start {INSTALLED}"
        (tmp_path / name).write_text(text.replace(INSTALLED, str(ours)))
    result = subprocess.run(
        [analyze, "verify", *(str(tmp_path / name) for name in names)], capture_output=True, text=True, timeout=60
    )
    # verify exits 0 on many a warning ("Unknown key", "Failed to parse"), each naming the
    # unit's file; it may also talk about units of this machine that are none of ours.
    said = (result.stdout + result.stderr).splitlines()
    complaints = [line for line in said if "ps-daemon" in line]
    if result.returncode != 0:
        complaints.append(f"exit code {result.returncode}: {result.stderr.strip()}")
    return complaints


def _units() -> dict[str, str]:
    return {name: (SYSTEMD / name).read_text() for name in (UNIT, TEMPLATE)}


def _settings(text: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def _seconds(timespan: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)", timespan)
    assert match, f"write {timespan!r} as Ns or Nmin"
    return int(match.group(1)) * (60 if match.group(2) == "min" else 1)


def test_units_pass_systemd_analyze_verify(tmp_path):
    # ps-daemon@example.service: the template with an instance name filled in.
    assert _verify(tmp_path, _units(), UNIT, TEMPLATE, "ps-daemon@example.service") == []


def test_verify_reports_a_broken_unit(tmp_path):
    broken = _units()[UNIT].replace("ProtectSystem=strict", "ProtectSystem=stricter")
    complaints = _verify(tmp_path, {UNIT: broken}, UNIT)
    assert any("stricter" in line for line in complaints), complaints


def test_template_is_the_unit_per_instance():
    unit, template = (_settings(text) for text in _units().values())
    assert template["ExecStart"] == [f"{INSTALLED} serve --config /etc/ps-daemon/%i.toml"]
    assert template["ReadWritePaths"] == ["-/mnt/nvme/ps-daemon/%i"]
    per_instance = {"Description", "ExecStart", "ReadWritePaths"}
    assert {k: v for k, v in template.items() if k not in per_instance} == {
        k: v for k, v in unit.items() if k not in per_instance
    }


def test_example_config_loads_and_names_every_key():
    path = SYSTEMD / "ps-daemon.toml"
    load_config(path)
    table = tomllib.loads(path.read_text())
    written = {f"{section}.{key}" for section, keys in table.items() for key in keys}
    known = {
        f"{section.name}.{key.name}"
        for section in dataclasses.fields(DaemonConfig)
        for key in dataclasses.fields(section.default_factory)
    }
    assert written == known


def test_units_agree_with_the_example_config():
    config = load_config(SYSTEMD / "ps-daemon.toml")
    unit = _settings(_units()[UNIT])
    assert unit["Type"] == ["notify"]
    assert unit["ExecStart"] == [f"{INSTALLED} serve --config /etc/ps-daemon/ps-daemon.toml"]
    assert unit["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert unit["Restart"] == ["on-failure"]
    assert unit["RestartPreventExitStatus"] == ["2"]  # ps-daemon's exit code for a bad config
    # systemd must not SIGKILL a daemon that is still draining.
    assert _seconds(unit["TimeoutStopSec"][0]) > config.server.grace_seconds + 10
    # The one writable place beside the state directory is the NVMe directory.
    assert unit["ReadWritePaths"] == [f"-{config.store.nvme_dir}"]
    assert unit["ProtectSystem"] == ["strict"]
    assert unit["CapabilityBoundingSet"] == [""]
    assert _seconds(unit["WatchdogSec"][0]) >= 10
