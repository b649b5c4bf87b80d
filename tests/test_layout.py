"""The package layout as rules (docs/development.md draws them): who may import whom, no private names across packages,
modules that fit in one sitting, and the plugins' signatures that show every knob."""

import ast
import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_mp
from lightning_mp.fabric import MixedPrecisionPlugin as FabricPlugin
from lightning_mp.numerics.loss_scaler import LossScaler, ScalerSettings

ROOT = Path(lightning_mp.__file__).parent
REPO = ROOT.parent

# package -> the lightning_mp packages it must not import (and whether it may import Lightning itself)
FORBIDDEN = {
    "numerics": ({"policy", "gemm", "fp8", "doctor", "core", "lightning", "fabric", "monitors", "demos"}, False),
    "policy": ({"numerics", "gemm", "fp8", "doctor", "core", "lightning", "fabric", "monitors", "demos"}, False),
    "gemm": ({"numerics", "policy", "fp8", "doctor", "core", "lightning", "fabric", "monitors", "demos"}, False),
    "fp8": ({"policy", "doctor", "core", "lightning", "fabric", "monitors", "demos"}, False),
    "doctor": ({"fp8", "core", "lightning", "fabric", "monitors", "demos"}, False),
    "core": ({"lightning", "fabric", "monitors", "demos"}, False),
    "lightning": ({"fabric", "monitors", "demos"}, True),
    "fabric": ({"lightning", "demos"}, True),
    "monitors": ({"fabric", "demos"}, True),
}
LONG_DATA_MODULES = {"policy/ops.py", "policy/aten.py"}  # tables of ops and their reasons


def modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        package = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem == "core" else ""
        yield path, rel, package


def imports(path):
    """(module imported, names imported from it) for every import in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [alias.name for alias in node.names]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_each_package_imports_only_what_sits_below_it(package):
    forbidden, lightning_allowed = FORBIDDEN[package]
    offences = []
    for path, rel, pkg in modules():
        if pkg != package:
            continue
        for module, _ in imports(path):
            parts = module.split(".")
            if parts[0] == "lightning_mp" and len(parts) > 1 and parts[1] in forbidden:
                offences.append(f"{rel} imports {module}")
            if not lightning_allowed and parts[0] in {"lightning", "lightning_fabric", "pytorch_lightning"}:
                offences.append(f"{rel} imports Lightning ({module})")
    assert not offences, "\n".join(offences)


def test_no_module_imports_a_private_name_from_another_package():
    offences = []
    for path, rel, package in modules():
        for module, names in imports(path):
            parts = module.split(".")
            if parts[0] != "lightning_mp":
                continue
            other = parts[1] if len(parts) > 2 or parts[1:] == ["core"] else ""
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and other != package:
                offences.append(f"{rel} imports {private} from {module}")
            if any(p.startswith("_") and p != "__init__" for p in parts[1:]) and other != package and rel.name != "__init__.py":
                offences.append(f"{rel} imports the private module {module}")
    assert not offences, "\n".join(offences)


def test_modules_fit_in_one_sitting_and_the_front_ends_are_thin():
    sizes = {str(rel): len(path.read_text().splitlines()) for path, rel, _ in modules()}
    too_long = {m: n for m, n in sizes.items() if n > 300 and m not in LONG_DATA_MODULES}
    assert not too_long
    assert sizes["lightning/plugin.py"] <= 250 and sizes["fabric/plugin.py"] <= 250


def test_neither_front_end_inherits_from_the_other():
    assert not issubclass(FabricPlugin, lightning_mp.MixedPrecisionPlugin)
    assert not issubclass(lightning_mp.MixedPrecisionPlugin, FabricPlugin)


@pytest.mark.parametrize("cls", [lightning_mp.MixedPrecisionPlugin, FabricPlugin, LossScaler])
def test_every_scaler_knob_is_in_the_signature_with_the_one_declared_default(cls):
    params = inspect.signature(cls).parameters
    for field in dataclasses.fields(ScalerSettings):
        assert params[field.name].default == field.default, field.name
        assert params[field.name].kind is inspect.Parameter.KEYWORD_ONLY
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_lightning_cli_help_lists_every_knob_with_its_default():
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_gpt.py"), "--trainer.plugins.help", "lightning_mp.MixedPrecisionPlugin"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    names = ["precision", "master_weights", "loss_scale", "fp32_ops", "fp32_modules", "gemm", "check_finite",
             "fp8_recipe", "fp8_modules"]
    for name in names + [field.name for field in dataclasses.fields(ScalerSettings)]:
        # jsonargparse before 4.32 spells it --trainer.plugins.init_args.NAME
        assert re.search(rf"--trainer\.plugins\.(init_args\.)?{name}\b", out.stdout), name
    assert "default: 65536.0" in out.stdout and "default: 2000" in out.stdout


def test_the_old_module_paths_still_import_with_a_deprecation_warning():
    sys.modules.pop("lightning_mp.fp32_policy", None)
    with pytest.warns(DeprecationWarning, match=r"lightning_mp.fp32_policy is deprecated: import from lightning_mp\.policy\.policy"):
        import lightning_mp.fp32_policy as old  # noqa: F401
    from lightning_mp.policy import policy

    assert old is policy
