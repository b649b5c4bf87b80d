"""The GPU check's first lines: the machine, and one line per optional piece, present or absent, with what follows.

    python3 benchmarks/gpu_env.py
    python3 benchmarks/gpu_env.py --probe-wheel DIR   # write a tiny pure-Python wheel into DIR (the dry run's)

Run by ``scripts/gpu_check.sh`` after the carried wheels are installed, so a piece that came from the wheel folder
shows where it was found. Imports nothing it reports on until it checks it (a missing piece is a line, not an error).
"""

from __future__ import annotations

import base64
import configparser
import hashlib
import importlib.metadata
import importlib.util
import re
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torch_floor() -> tuple[int, ...] | None:
    """The lowest torch setup.cfg accepts (``torch>=X.Y``), or None where it names none."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    requires = cfg.get("options", "install_requires", fallback="")
    match = re.search(r"^\s*torch\s*>=\s*([0-9.]+)", requires, re.M)
    return tuple(int(p) for p in match.group(1).split(".")) if match else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _where(module: str) -> str:
    spec = importlib.util.find_spec(module)
    origin = spec.origin if spec is not None and spec.origin else ""
    return " (from the carried wheels)" if "gpu_wheels" in origin or "gpu_check_wheels" in origin else ""


def pieces() -> list[str]:
    """One line per piece: ``name: version or absent -> what that means for this check``."""
    import torch

    lines = []
    release = tuple(int(p) for p in re.findall(r"\d+", torch.__version__.split("+")[0])[:2])
    floor = torch_floor()
    floor_text = ".".join(map(str, floor)) if floor else "none"
    if floor is None or release >= floor[:2]:
        verdict = f"at or above our floor ({floor_text})"
    else:
        verdict = f"BELOW our floor ({floor_text}): failures may be the version's, not the GPU's"
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA build"
    lines.append(f"torch {torch.__version__}: {verdict}; {cuda}, device available: {torch.cuda.is_available()}")
    if importlib.util.find_spec("torchao") is None:
        lines.append("torchao: absent -> no FP8 rows in the table ('skipped: no torchao'), the FP8 tests skip. "
                     "HINT: fill gpu_wheels/ (docs/benchmarks.md) and carry it")  # fmt: skip
    else:
        lines.append(f"torchao {_version('torchao')}{_where('torchao')}: present -> FP8 rows and FP8 tests run")
    if importlib.util.find_spec("transformer_engine") is None:
        lines.append("Transformer Engine: absent -> no Lightning TransformerEnginePrecision row (the torchao row is "
                     "the FP8 a Lightning user has)")  # fmt: skip
    else:
        version = _version("transformer_engine")
        lines.append(f"Transformer Engine {version}: present -> a TransformerEnginePrecision row")
    if importlib.util.find_spec("jsonargparse") is None:
        lines.append("jsonargparse: absent -> nothing here needs it (LightningCLI does; no CUDA-suite test uses it)")
    else:
        lines.append(f"jsonargparse {_version('jsonargparse')}{_where('jsonargparse')}: present")
    return lines


PROBE = "gpu_check_probe"


def probe_wheel(folder: Path) -> Path:
    """Write ``gpu_check_probe-1.0-py3-none-any.whl`` (one module, ``VERSION = "1.0"``) into ``folder``: a wheel made
    with no network and no build backend, so the dry run installs from a local wheel folder the way the GPU run does."""
    files = {
        f"{PROBE}/__init__.py": 'VERSION = "1.0"\n',
        f"{PROBE}-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 1.0\n",
        f"{PROBE}-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: gpu_env\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }

    def digest(text: str) -> str:
        raw = hashlib.sha256(text.encode()).digest()
        return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    record = f"{PROBE}-1.0.dist-info/RECORD"
    files[record] = "".join(f"{n},{digest(t)},{len(t.encode())}\n" for n, t in files.items()) + f"{record},,\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{PROBE}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)
    return path


def main() -> int:
    if sys.argv[1:2] == ["--probe-wheel"]:
        print(f"wrote {probe_wheel(Path(sys.argv[2]))}")
        return 0
    import lightning
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(f"python {'.'.join(map(str, sys.version_info[:3]))} | lightning {lightning.__version__} | "
          f"GPU: {gpu}")  # fmt: skip
    for line in pieces():
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
