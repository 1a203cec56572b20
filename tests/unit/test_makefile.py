"""`make help` lists every target, one line each, grouped; it is read from the Makefile itself
(`target: ... ## help`, `##@ group`), so a target without a help line is a failure here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = (ROOT / "Makefile").read_text()
GROUPS = ["Set up, run and test", "Benchmarks", "Tools"]


def phony() -> set[str]:
    (names,) = re.findall(r"^\.PHONY:((?:.*\\\n)*.*)$", MAKEFILE, re.M)
    return set(names.replace("\\\n", " ").split())


def rules() -> set[str]:
    """Every rule's target that is a name, not a file or a variable assignment."""
    return set(re.findall(r"^([a-z][\w-]*):(?!=)", MAKEFILE, re.M))


def helped() -> dict[str, str]:
    return dict(re.findall(r"^([a-z][\w-]*):(?!=).*?## (.+)$", MAKEFILE, re.M))


def test_every_target_is_phony_and_has_a_help_line() -> None:
    assert rules() == phony(), f"not .PHONY: {rules() - phony()}; no rule: {phony() - rules()}"
    assert set(helped()) == phony(), f"no help line: {sorted(phony() - set(helped()))}"


def test_make_help_lists_every_target_once_under_its_group() -> None:
    done = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    listed = [ln.split()[0] for ln in lines if ln.startswith("  ")]
    assert sorted(listed) == sorted(phony())
    headers = [ln for ln in lines if ln and not ln.startswith(" ")]
    assert [h for g in GROUPS for h in headers if h.startswith(g)] == headers
    for target, text in helped().items():
        assert f"  {target:<24} {text}" in lines


def test_make_alone_still_sets_up() -> None:
    """The default goal stays `setup`: `make` on a fresh machine installs, as it always did."""
    assert re.search(r"^\.DEFAULT_GOAL := setup$", MAKEFILE, re.M)
