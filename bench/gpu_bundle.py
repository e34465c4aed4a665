"""`make gpu-bundle`: what an air-gapped CUDA host lacks to run `make gpu-check`, in .cache/gpu-bundle (git-ignored,
small enough to travel with the working tree).

Such a host has Python 3.12 with PyTorch (CUDA), numpy and pytest, and no package index. The bundle holds the wheels
of every package lockstep and the check import beyond those, at the versions this venv tested (pure-Python wheels,
and manylinux builds for CPython 3.12 and for this interpreter where a package has native code), their pinned list,
and the embedded model's shape: its config and tokenizer. Its weights (a 98 MB GGUF) do not fit what travels, so the
check serves random weights of that shape: the speed of a forward does not depend on the weights' values.
"""
import argparse
import configparser
import logging
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
BUNDLE = REPO / ".cache" / "gpu-bundle"
GPU_PYTHON = "3.12"
# What the check imports beyond lockstep's own requirements: the benchmark's client and process watch.
CHECK_REQUIREMENTS = ("psutil", "websocket-client", "tqdm")
# What the GPU host brings (and everything these need): never bundled.
HOST_PACKAGES = ("torch", "numpy", "pytest")
MAX_BUNDLE_MIB = 50  # the tree and the bundle travel within 64 MiB
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
NOT_THE_SHAPE = ("model.safetensors.index.json", "lockstep-gguf.json")  # they name weights that do not travel


def lockstep_requirements() -> list[str]:
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    lines = parser["options"]["install_requires"].splitlines()
    return [Requirement(line).name for line in lines if line.strip() and not line.strip().startswith("#")]


def dependency_closure(names, skip: frozenset[str] = frozenset()) -> dict[str, str]:
    """{name: installed version} of `names` and everything they require here (markers evaluated for this host),
    less `skip`."""
    found: dict[str, str] = {}
    todo = [canonicalize_name(name) for name in names]
    while todo:
        name = todo.pop()
        if name in found or name in skip:
            continue
        distribution = metadata.distribution(name)
        found[name] = distribution.version
        for text in distribution.requires or ():
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
    return found


def bundled_pins() -> list[str]:
    host = frozenset(dependency_closure(HOST_PACKAGES))
    wanted = [name for name in lockstep_requirements() if canonicalize_name(name) not in host]
    closure = dependency_closure([*wanted, *CHECK_REQUIREMENTS], skip=host)
    return [f"{name}=={version}" for name, version in sorted(closure.items())]


def download(pins: list[str], wheels: Path) -> None:
    """Wheels only (nothing is built on the GPU host): CPython 3.12 manylinux x86-64, and this interpreter's."""
    base = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
            "--only-binary=:all:", "--dest", str(wheels)]
    platforms = ["manylinux2014_x86_64"] + [f"manylinux_2_{minor}_x86_64" for minor in range(17, 40)]
    gpu_host = ["--python-version", GPU_PYTHON, "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
                "--abi", "none"] + [arg for platform in platforms for arg in ("--platform", platform)]
    subprocess.run([*base, *gpu_host, *pins], check=True)
    subprocess.run([*base, *pins], check=True)


def copy_model_shape(model_dir: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix not in WEIGHT_SUFFIXES and path.name not in NOT_THE_SHAPE:
            shutil.copy2(path, target / path.name)


def folder_mib(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) / 2**20


def build_bundle(bundle: Path, model_dir: Path) -> float:
    if bundle.exists():
        shutil.rmtree(bundle)
    wheels = bundle / "wheels"
    pins = bundled_pins()
    download(pins, wheels)
    (bundle / "requirements.txt").write_text("\n".join(pins) + "\n")
    copy_model_shape(model_dir, bundle / "model-shape")
    size = folder_mib(bundle)
    if size > MAX_BUNDLE_MIB:
        raise SystemExit(f"gpu-bundle: {size:.1f} MiB is over {MAX_BUNDLE_MIB} MiB, too much to travel with the tree")
    return size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=BUNDLE)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from engine import EngineConfig
    from engine.model_store import resolve_model

    size = build_bundle(args.out, Path(resolve_model(EngineConfig())))
    logger.info("gpu-bundle: %s, %.1f MiB (%d wheels)", args.out, size, len(list((args.out / "wheels").iterdir())))


if __name__ == "__main__":
    main()
