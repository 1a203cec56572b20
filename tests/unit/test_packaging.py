"""Ferry installs as ``ferry.*`` only: the top-level folders map to ``ferry.<folder>``, every
package is in the distribution, and nothing is importable under a folder's bare name."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("services", "gateway", "kernels", "infra", "protos")


def _setuptools() -> dict[str, object]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(config["tool"]["setuptools"])


def _in_folders(path: str) -> bool:
    """``path`` is a file of one of the folders that install as ferry.*."""
    return any(Path(path).is_relative_to(ROOT / f) for f in FOLDERS)


def test_every_folder_with_an_init_is_a_listed_ferry_package() -> None:
    on_disk = sorted(
        "ferry." + ".".join(init.parent.relative_to(ROOT).parts)
        for folder in FOLDERS
        for init in (ROOT / folder).rglob("__init__.py")
    )
    assert sorted(_setuptools()["packages"]) == on_disk  # type: ignore[arg-type]


def test_the_folders_map_to_ferry_names() -> None:
    assert _setuptools()["package-dir"] == {f"ferry.{f}": f for f in FOLDERS}


def test_bare_folder_names_do_not_import() -> None:
    """Run from elsewhere (as an installed Ferry is), nothing answers to a folder's name; in a
    test process (the root is at the end of sys.path, tests/conftest.py) an installed module of
    the same name comes first."""
    code = (
        "import importlib.util as u, json\n"
        f"print(json.dumps({{n: str(s.origin) for n in {FOLDERS!r} if (s := u.find_spec(n))}}))"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    outside = json.loads(run.stdout)
    # Hugging Face's `kernels` may be installed (transformers 5.25 depends on it): not ours
    assert not [o for o in outside.values() if _in_folders(o)], outside
    kernels = importlib.util.find_spec("kernels")
    assert kernels is None or not _in_folders(str(kernels.origin)), kernels


def test_no_module_is_loaded_under_two_names() -> None:
    import ferry.gateway.app
    import ferry.infra.cli
    import ferry.services.scheduler.service
    import ferry.services.worker.decode
    import ferry.services.worker.prefill  # noqa: F401

    ours = {
        name: path
        for name, module in list(sys.modules.items())
        if _in_folders(path := str(getattr(module, "__file__", None) or ""))
    }
    assert ours
    assert [n for n in ours if not n.startswith("ferry.")] == []
    assert len(set(ours.values())) == len(ours), "a file loaded under two module names"
