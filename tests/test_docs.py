"""The documentation site: it builds with warnings as errors, its API reference names every public object, every page
is in the navigation, and the README sections the home page includes exist.

The strict build needs the ``site`` extra (``pip install -e ".[site]"``); without it that test skips and says so.
``.ci/run`` installs the extra and builds the site itself, so CI never skips the build."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import lightning_mp
import lightning_mp.fabric

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API = DOCS / "api.md"
NOT_IN_NAV = {"pypi.md"}  # the wheel's package page, not a page of the site


def documented_objects() -> set[str]:
    """The objects ``docs/api.md`` renders with mkdocstrings (``::: dotted.path`` lines)."""
    return set(re.findall(r"^::: ([\w.]+)\s*$", API.read_text(encoding="utf-8"), re.MULTILINE))


def nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_public_name_is_in_the_api_reference():
    documented = documented_objects()
    missing = [f"lightning_mp.{name}" for name in lightning_mp.__all__ if f"lightning_mp.{name}" not in documented]
    missing += [
        f"lightning_mp.fabric.{name}"
        for name in lightning_mp.fabric.__all__
        if f"lightning_mp.fabric.{name}" not in documented
    ]
    assert not missing, f"public names without a `::: name` entry in docs/api.md: {missing}"


def test_every_documented_object_exists():
    for path in documented_objects():
        module, _, name = path.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            obj = importlib.import_module(path)
        assert obj is not None, path


def test_every_page_is_in_the_navigation_and_every_nav_entry_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = nav_pages(config["nav"])
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name not in NOT_IN_NAV)
    assert sorted(nav) == pages, f"mkdocs.yml nav {sorted(nav)} != docs pages {pages}"


def test_the_readme_sections_the_site_includes_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in DOCS.glob("*.md"):
        for section in re.findall(r'^--8<-- "README\.md:(\w+)"$', page.read_text(encoding="utf-8"), re.MULTILINE):
            start, end = f"--8<-- [start:{section}]", f"--8<-- [end:{section}]"
            assert start in readme and end in readme and readme.index(start) < readme.index(end), (
                f"{page.name} includes README.md:{section}, but README.md has no such section (markers {start!r} and "
                f"{end!r}); a README edit removed it"
            )


def test_the_readme_is_a_users_page_of_at_most_300_lines():
    """The README holds the commands, the knobs and the tags; measurements and how they were taken live in docs/."""
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= 300, (
        f"README.md has {lines} lines, over the 300 of a user's page. HINT: move measurements and their methods to "
        "docs/benchmarks.md or docs/behaviour.md and link them."
    )


def test_the_pages_keep_no_lab_notebook_history():
    """The pages say what is true now; measurement history belongs in the commit log."""
    pages = [ROOT / "README.md", *DOCS.glob("*.md")]
    words = ("this round", "predates", "the seed's", "load 9", "not yet explained")
    found = [(p.name, w) for p in pages for w in words if w in p.read_text(encoding="utf-8").lower()]
    assert not found, found


def test_the_api_reference_renders_rest_tables_roles_and_literal_blocks_as_markdown():
    if not _importable("griffe"):
        pytest.skip("griffe (a dependency of the site extra) is not installed: pip install -e '.[site]'")
    spec = importlib.util.spec_from_file_location("griffe_markdown", DOCS / "griffe_markdown.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = """See :class:`lightning_mp.OverflowLocator` and :meth:`~OverflowLocator.report`.

==========================  ====================================
Key                         Logged value
==========================  ====================================
``precision/loss_scale``    the scale, log2|s| of it, or
                            ``|g| * scale`` in code
``precision/skipped``       a count
==========================  ====================================

Example::

    locator.report()"""
    lines = module.to_markdown(text).splitlines()
    assert lines[0] == "See `lightning_mp.OverflowLocator` and `report`."
    assert "| Key | Logged value |" in lines
    assert "| ``precision/loss_scale`` | the scale, log2\\|s\\| of it, or ``|g| * scale`` in code |" in lines
    assert "| ``precision/skipped`` | a count |" in lines
    assert "Example" in lines and "    locator.report()" in lines and not any(line.endswith("::") for line in lines)


@pytest.mark.slow
def test_the_docs_build_with_warnings_as_errors(tmp_path):
    missing = [m for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python") if not _importable(m)]
    if missing:
        pytest.skip(f"the documentation tools are not installed ({', '.join(missing)}): pip install -e '.[site]'")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{output[-5000:]}"
    assert "WARNING" not in output, output[-5000:]
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for path in documented_objects():
        assert f'id="{path}"' in api, f"{path} is not rendered in the API reference"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False
