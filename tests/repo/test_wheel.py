"""An installed wheel works (issue 62): it holds every file of the package git tracks (the kernels' C++ and its .inc
files, the CUDA sources, the page), and in a fresh virtualenv, away from this checkout, it builds its C++ kernels from
its own sources and finds its page."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, cwd=out, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (found,) = out.glob("webchat-*.whl")
    return found


def test_the_wheel_holds_every_file_of_the_package(wheel: Path) -> None:
    tracked = subprocess.run(["git", "ls-files", "webchat"], capture_output=True, text=True, cwd=ROOT,
                             check=True).stdout.split()
    packed = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(f for f in tracked if f not in packed)
    assert missing == [], f"the wheel lacks {missing}"
    assert any(n.endswith(".inc") for n in packed) and "webchat/serve/page/templates/index.html" in packed


def test_an_installed_wheel_builds_its_kernels_and_finds_its_page(wheel: Path, tmp_path: Path) -> None:
    """A fresh virtualenv whose dependencies come from this one (a .pth line: nothing downloaded), the wheel
    installed with no dependencies, run from an empty folder with a fresh WEBCHAT_HOME: the kernels build from the
    installed sources and load; the page's template is inside the package."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, str(wheel)],
                   check=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WEBCHAT_HOME")}
    env.update(WEBCHAT_HOME=str(home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    code = ("import webchat, webchat.kernels.cpu.build as b, webchat.serve.config as c\n"
            "m = b.load()\n"
            "print(webchat.__file__)\n"
            "print(b.CSRC)\n"
            "print(b.path_name(m))\n"
            "print(c.PAGE / 'templates' / 'index.html')\n")
    run = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=work, env=env, timeout=1100)
    assert run.returncode == 0, run.stderr[-3000:]
    package, csrc, path, page = run.stdout.split("\n")[:4]
    assert Path(package).is_relative_to(site) and Path(csrc).is_relative_to(site), (package, csrc, site)
    assert path in ("scalar", "avx2", "avx512") and Path(page).is_file()
    assert any(home.rglob("*.so")), "no kernels were built into the fresh WEBCHAT_HOME"
