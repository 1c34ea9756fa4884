"""The torch-npu wheel the emulation reads its API from: pinned here, fetched once, never installed.

The wheel is downloaded with pip (``pip download --no-deps``; importing torch_npu without CANN
breaks
``import torch``, so it is only unzipped) into ``$XHAL_CACHE_DIR/torch-npu-<version>/`` (default
``~/.cache/xhal``), and the few text files the emulation reads are extracted next to it. Later runs,
and the subprocesses of a run (conformance, the server), find them there and download nothing.
Neither the wheel (43 MB) nor the extracted files (1.7 MB) are committed: they are Ascend's files,
read at test time.

When the wheel cannot be had (no network, no pip), ``wheel_files()`` raises ``WheelUnavailable``
with the reason; the NPU tests turn that into a skip that says so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from xhal.env import cache_dir

TORCH_NPU_VERSION = "2.14.0"  # the one pin: schemas, docs and meta functions all come from it
# the files are the same text in every build of a release; pin one build so any host fetches it
_PIP_TARGET = (
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
    "--platform",
    "manylinux_2_28_x86_64",
    "--only-binary=:all:",
)

_MEMBERS = {
    "yaml": "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml",
    "docs": "torch_npu/_op_plugin_docs.py",
    "meta": "torch_npu/op_plugin/meta/_meta_registrations.py",
    "atb_header": "torch_npu/include/third_party/op-plugin/op_plugin/include/AtbOpsInterface.h",
    "atb_docs": "torch_npu/op_plugin/atb/_atb_api_docs.py",
    "atb_meta": "torch_npu/op_plugin/atb/_atb_meta_registrations.py",
    "npu_init": "torch_npu/npu/__init__.py",  # the torch.npu namespace (__all__)
}


class WheelUnavailable(RuntimeError):
    """The pinned torch-npu wheel could not be downloaded or read; the message says why."""


@dataclass(frozen=True)
class WheelFiles:
    """Paths of the extracted files of the pinned wheel."""

    version: str
    yaml: Path  # op schemas (codegen input): one ``func:`` line per op
    docs: Path  # official op documentation (Chinese)
    meta: Path  # shape / dtype functions over the Meta device
    atb_header: Path  # C++ signatures of the ATB ops
    atb_docs: Path
    atb_meta: Path
    npu_init: Path  # torch_npu/npu/__init__.py: what torch.npu exports


def cache_root() -> Path:
    return Path(cache_dir()) / f"torch-npu-{TORCH_NPU_VERSION}"


_found: WheelFiles | None = None


def wheel_files() -> WheelFiles:
    """The extracted files, downloading and extracting the wheel the first time (per machine)."""
    global _found
    if _found is None:
        root = cache_root()
        extracted = root / "extracted"
        if not all((extracted / m).is_file() for m in _MEMBERS.values()):
            _extract(_download(root), extracted)
        _found = WheelFiles(TORCH_NPU_VERSION, **{k: extracted / m for k, m in _MEMBERS.items()})
    return _found


def _download(root: Path) -> Path:
    wheels = sorted(root.glob("torch_npu-*.whl"))
    if wheels:
        return wheels[0]
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            *_PIP_TARGET,
            f"torch-npu=={TORCH_NPU_VERSION}",
            "-d",
            tmp,
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise WheelUnavailable(f"`{' '.join(cmd)}` could not run: {err}") from err
        got = sorted(Path(tmp).glob("torch_npu-*.whl"))
        if done.returncode or not got:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise WheelUnavailable(
                f"downloading torch-npu=={TORCH_NPU_VERSION} failed ({' | '.join(tail)}); the NPU "
                f"emulation reads its op schemas from that wheel. Put the wheel in {root} by hand "
                "or allow pip to reach PyPI"
            )
        target = root / got[0].name
        os.replace(got[0], target)  # atomic: a concurrent run sees the whole wheel or none
    return target


def _extract(wheel: Path, extracted: Path) -> None:
    extracted.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=extracted.parent))
    try:
        with zipfile.ZipFile(wheel) as zf:
            for member in _MEMBERS.values():
                zf.extract(member, tmp)
    except (zipfile.BadZipFile, KeyError, OSError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise WheelUnavailable(
            f"{wheel} is not a readable torch-npu wheel ({err}); delete it to download it again"
        ) from err
    if extracted.exists() and not all((extracted / m).is_file() for m in _MEMBERS.values()):
        shutil.rmtree(extracted, ignore_errors=True)  # from an older member list: redo it
    try:
        os.replace(tmp, extracted)
    except OSError:  # another process extracted it first
        shutil.rmtree(tmp, ignore_errors=True)
