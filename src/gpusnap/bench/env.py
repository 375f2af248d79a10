"""Where the figures were measured: GPU, driver, versions, date, filesystems."""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import platform
import subprocess
import sys
from importlib import metadata
from typing import Any

import torch

import gpusnap

__all__ = ["CPU_DISCLAIMER", "environment", "fs_type"]

CPU_DISCLAIMER = "CPU: not a performance claim (tiny sizes: a smoke test of the bench itself)"


def fs_type(path: str) -> str:
    """Filesystem type of the mount holding ``path`` ("tmpfs", "ext4", ...; "?" if unknown)."""
    path = os.path.realpath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                inside = len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/"))
                if inside and len(parts[1]) >= len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(gpusnap.__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def source_digest(root: str | None = None) -> str:
    """12 hex digits of SHA-256 over the package's Python sources (relative path and bytes,
    in path order). The git stamp can be stale where a tree is copied with old git metadata
    (a working tree copied onto another machine); this names the code that ran. Compare with a checkout:
    ``python -c "from gpusnap.bench.env import source_digest; print(source_digest())"``.
    """
    root = root or os.path.dirname(os.path.abspath(gpusnap.__file__))
    files = sorted(
        os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
        for d, _, names in os.walk(root) for f in names if f.endswith(".py")
    )
    digest = hashlib.sha256()
    for rel in files:
        with open(os.path.join(root, rel), "rb") as fh:
            data = fh.read()
        digest.update(f"{rel}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:12]


def _driver_api_version() -> int | None:
    from gpusnap.bench.driver_ckpt import load_driver

    driver, _ = load_driver()
    if driver is None:
        return None
    try:
        err, version = driver.cuDriverGetVersion()
    except Exception:  # noqa: BLE001  an informational field must never fail the run
        return None
    return int(version) if err == driver.CUresult.CUDA_SUCCESS else None


def environment(device: torch.device, roots: dict[str, str]) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "gpusnap": gpusnap.__version__,
        "gpusnap_commit": _git_commit(),
        "gpusnap_source": source_digest(),
        "transformers": _version("transformers"),
        "torchvision": _version("torchvision"),
        "cuda_python": _version("cuda-python") or _version("cuda-bindings"),
        "command": " ".join(["gpusnap"] + sys.argv[1:]) if sys.argv and sys.argv[0].endswith("gpusnap") else None,
        "filesystems": {name: {"path": path, "type": fs_type(path)} for name, path in roots.items()},
    }
    try:
        env["ram_bytes"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        env["ram_bytes"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["gpu_memory_bytes"] = props.total_memory
        env["gpu_count"] = torch.cuda.device_count()
        env["driver"] = _nvidia_smi("driver_version")
        env["cuda_driver_api"] = _driver_api_version()
    else:
        env["gpu"] = None
        env["disclaimer"] = CPU_DISCLAIMER
    return env
