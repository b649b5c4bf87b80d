"""The package as a user gets it: ``pip wheel`` builds it, the wheel carries the LICENSE and a package page without
repository-relative images, and in a fresh virtual environment (no system site-packages, nothing but the wheel and
its dependencies, run outside the checkout) the first ```python block of README.md and of the package page runs.

One wheel and one environment for the module (about a minute: the build, then pip resolving the dependencies; torch
is pinned to the build this test runs under, since an unpinned torch would fetch pip's default build for the
platform, on Linux the CUDA one, gigabytes). Needs the package index, as ``.ci/run`` does."""

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import lightning_mp

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# what `pip wheel` would otherwise write into or read from the checkout (build/, egg-info) or what it needs not copy
_NOT_COPIED = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
               "lightning_logs", "runs", "*.ckpt")  # fmt: skip
_FIRST_PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_RELATIVE_IMAGE = re.compile(r"!\[[^\]]*\]\((?![a-z][a-z0-9+.-]*://)([^)]*)\)|<img[^>]*src=\"(?![a-z]+://)([^\"]*)\"")


def _run(argv, *, cwd, timeout, env=None):
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _clean_env():
    """The environment of a user's shell: nothing that points Python at the checkout or at this test's venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def first_python_block(path):
    """The first ```python fenced block of a Markdown file, read now (the README is rewritten often)."""
    found = _FIRST_PYTHON_BLOCK.search(path.read_text(encoding="utf-8"))
    if found is None:
        pytest.fail(f"{path.relative_to(ROOT)} has no ```python fenced block; its first one is run as a user's example")
    return found.group(1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel ``pip wheel . --no-deps`` builds from a copy of the checkout (the checkout's build/ neither read nor
    written, so a stale build/lib cannot hide a missing file)."""
    base = tmp_path_factory.mktemp("packaging")
    source = base / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*_NOT_COPIED))
    out = base / "dist"
    done = _run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--quiet", "-w", str(out)],
                cwd=base, timeout=600)  # fmt: skip
    assert done.returncode == 0, f"`pip wheel . --no-deps` failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, f"expected one wheel, got {[w.name for w in wheels]}"
    return wheels[0]


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory):
    """A fresh venv with the wheel and its dependencies installed by pip, as a user would (torch pinned, see above)."""
    base = tmp_path_factory.mktemp("clean_env")
    venv = base / "venv"
    done = _run([sys.executable, "-m", "venv", str(venv)], cwd=base, timeout=300, env=_clean_env())
    assert done.returncode == 0, f"python -m venv failed:\n{done.stderr[-3000:]}"
    python = venv / ("Scripts" if os.name == "nt" else "bin") / ("python.exe" if os.name == "nt" else "python")
    constraints = base / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__}\n")
    done = _run([str(python), "-m", "pip", "install", "--quiet", "-c", str(constraints), str(wheel)],
                cwd=base, timeout=900, env=_clean_env())  # fmt: skip
    assert done.returncode == 0, f"pip install of the wheel failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return python


def _wheel_text(wheel, name):
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(name).decode("utf-8")


def _dist_info_files(wheel):
    with zipfile.ZipFile(wheel) as archive:
        return [n for n in archive.namelist() if n.split("/", 1)[0].endswith(".dist-info")]


def _metadata(wheel):
    return _wheel_text(wheel, next(n for n in _dist_info_files(wheel) if n.endswith("/METADATA")))


def test_wheel_is_the_checkouts_version_and_ships_only_the_package(wheel):
    assert wheel.name.startswith(f"lightning_mp-{lightning_mp.__version__}-py3-none-any"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        top_level = {n.split("/", 1)[0] for n in archive.namelist()}
    # tests/, benchmarks/, examples/ and docs/ stay out of site-packages
    assert top_level == {"lightning_mp", f"lightning_mp-{lightning_mp.__version__}.dist-info"}, top_level


def test_wheel_carries_the_apache_license(wheel):
    licenses = [n for n in _dist_info_files(wheel) if n.rsplit("/", 1)[-1] == "LICENSE"]
    assert licenses, f"no LICENSE in the wheel's dist-info: {_dist_info_files(wheel)}"
    text = _wheel_text(wheel, licenses[0])
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    metadata = _metadata(wheel)
    assert re.search(r"^License(-Expression)?: Apache-2\.0$", metadata, re.MULTILINE), metadata[:1500]


def test_package_page_embeds_no_repository_relative_image(wheel):
    metadata = _metadata(wheel)
    headers, _, description = metadata.partition("\n\n")
    assert "Description-Content-Type: text/markdown" in headers
    assert description.strip(), "the wheel has no long description (the package page)"
    assert "docs/images" not in metadata
    relative = [m.group(1) or m.group(2) for m in _RELATIVE_IMAGE.finditer(description)]
    assert not relative, f"the package page embeds images by relative path, which an index cannot show: {relative}"


def test_declared_floors_are_the_versions_ci_tests(wheel):
    """``.ci/run``'s second job runs the suite on .ci/constraints-oldest.txt: the floors must be those pins."""
    oldest = {}
    for line in (ROOT / ".ci" / "constraints-oldest.txt").read_text().splitlines():
        requirement = line.split("#", 1)[0].strip()
        if "==" in requirement:
            name, pinned = requirement.split("==")
            oldest[name.strip()] = Version(pinned.strip())
    metadata = _metadata(wheel)
    floors = dict(re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)[^;\n]*?>=([0-9][^,;\s)]*)", metadata, re.MULTILINE))
    for name in ("torch", "lightning", "torchmetrics", "tensorboard", "jsonargparse", "torchao"):
        floor = Version(floors[name]).release
        assert floor + (0,) * (3 - len(floor)) == oldest[name].release[:3], (
            f"{name}: setup.cfg declares >={floors[name]}, .ci/constraints-oldest.txt pins {oldest[name]}"
        )


def test_installed_package_is_the_wheel_not_the_checkout(venv_python, tmp_path):
    probe = "import importlib.metadata as m, lightning_mp; print(lightning_mp.__file__, m.version('lightning-mp'))"
    done = _run([str(venv_python), "-c", probe], cwd=tmp_path, timeout=300, env=_clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    location, version = done.stdout.split()
    assert Path(location).resolve().is_relative_to(venv_python.parents[1].resolve()), location
    assert not Path(location).resolve().is_relative_to(ROOT), location
    assert version == lightning_mp.__version__ == importlib.metadata.version("lightning-mp")


@pytest.mark.parametrize("page", ["README.md", "docs/pypi.md"])
def test_first_python_block_runs_in_the_clean_environment(page, venv_python, tmp_path):
    code = first_python_block(ROOT / page)
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    try:
        done = _run([str(venv_python), str(script)], cwd=tmp_path, timeout=300, env=_clean_env())
    except subprocess.TimeoutExpired:
        pytest.fail(f"the first ```python block of {page} ran past 300 s in the clean environment: it is meant to be "
                    f"a small example a user copies")  # fmt: skip
    if done.returncode != 0:
        pytest.fail(
            f"the first ```python block of {page} does not run as written in a fresh environment where only the built "
            f"wheel and its dependencies are installed (cwd outside the checkout; exit {done.returncode}). A user "
            f"copies that block: it needs its imports, a model, data and `fit`.\n--- the block ---\n{code}"
            f"--- stderr (last 3000 characters) ---\n{done.stderr[-3000:]}",
            pytrace=False,
        )
