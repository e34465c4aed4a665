"""Building lockstep's C kernels on first use, with the system's C compiler, into the cache folder: one library
per source, flags and key (a CPU's flags, where the code is built for it), built into a temporary name and
renamed, so processes that build at once (gunicorn workers, tests) never load a half-written file."""
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 120


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def built_library(source: Path, folder: Path, compiler: str, flags: tuple[str, ...], link_flags: tuple[str, ...],
                  key: str = "") -> Path:
    """The library of `source`, built if it is not in `folder` yet. Raises OSError (or SubprocessError) if the
    compiler fails."""
    digest = hashlib.sha256(source.read_bytes() + " ".join((compiler, *flags, *link_flags, key)).encode())
    target = folder / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as building:
        built = Path(building) / target.name
        command = [compiler, *flags, str(source), "-o", str(built), *link_flags]
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(built, target)
    logger.info("built %s", target)
    return target
