"""Build llama.cpp's server and speculative-decoding tools from the source llama-cpp-python vendors.

    python tools/build_llama_cpp.py                  # prints the bin directory when done
    python tools/build_llama_cpp.py --sdist DIR/llama_cpp_python-0.3.36.tar.gz --jobs 16

The llama-cpp-python sdist carries llama.cpp's whole tree under `vendor/llama.cpp`; building that, and
not a llama.cpp checkout of some other date, pins the engine the measurements ran on to one version
that pip can fetch again. Without `--sdist` the script asks pip for it (`pip download --no-deps`,
which works from a local index or pip's cache as well as from PyPI).

CPU only, Release, static, tuned for this machine's CPU (GGML_NATIVE), no web UI (its assets would
be downloaded at build time), no HTTPS. It builds into `<cache>/llama.cpp/<version>/` (the selfspec
cache: `$SELFSPEC_CACHE_DIR`, else `$XDG_CACHE_HOME/selfspec`, else `~/.cache/selfspec`) and copies
the binaries to its `bin/`; a finished build is skipped (`--force` rebuilds). On a 2-core machine the
build takes 20-30 minutes; run it under `nice -n 19` when sharing the machine.

Exits non-zero with one line naming the fix when cmake, a C++ compiler or a build tool is missing or
the sdist cannot be found.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from selfspec.files import write_json_atomic

DEFAULT_VERSION = "0.3.36"
# The binaries the comparison uses: the OpenAI-compatible server (which drafts with --model-draft
# and, in this version, with its own n-gram drafters), and the standalone speculative/lookup examples.
TARGETS = ("llama-server", "llama-speculative", "llama-speculative-simple", "llama-lookup")


def cache_root() -> Path:
    """`<selfspec cache>/llama.cpp`, computed like selfspec.files.cache_dir without importing selfspec."""
    if os.environ.get("SELFSPEC_CACHE_DIR"):
        base = Path(os.environ["SELFSPEC_CACHE_DIR"])
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "selfspec"
    return base / "llama.cpp"


def bin_dir(version: str = DEFAULT_VERSION) -> Path:
    """Where a finished build's binaries are: `<cache>/llama.cpp/<version>/bin`."""
    return cache_root() / version / "bin"


def built(version: str = DEFAULT_VERSION) -> bool:
    """Whether a finished build of `version` is in the cache (its stamp and every binary)."""
    directory = bin_dir(version)
    return (directory.parent / "build.json").is_file() and all((directory / t).is_file() for t in TARGETS)


def _fail(message: str) -> None:
    print(f"build_llama_cpp: {message}", file=sys.stderr)
    raise SystemExit(1)


def _find_tools() -> tuple[str, str, str]:
    """(cmake, C++ compiler, generator) or a one-line exit naming what to install."""
    cmake = shutil.which("cmake")
    if cmake is None:
        _fail("cmake not found; install it (apt-get install cmake, or pip install cmake)")
    compiler = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if compiler is None or shutil.which(compiler) is None:
        _fail("no C++ compiler found (c++, g++, clang++ or $CXX); install one (apt-get install g++)")
    if shutil.which("ninja"):
        generator = "Ninja"
    elif shutil.which("make"):
        generator = "Unix Makefiles"
    else:
        _fail("neither ninja nor make found; install one (apt-get install ninja-build, or make)")
    return cmake, compiler, generator


def _find_sdist(sdist: str | None, version: str, root: Path) -> Path:
    if sdist is not None:
        path = Path(sdist)
        if not path.is_file():
            _fail(f"--sdist {path} is not a file; pass the llama_cpp_python-{version}.tar.gz "
                  f"that pip downloads")
        return path
    target = root / "sdist"
    found = sorted(target.glob(f"llama_cpp_python-{version}.tar.gz"))
    if found:
        return found[0]
    target.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                             f"llama-cpp-python=={version}", "-d", str(target)],
                            capture_output=True, text=True)
    found = sorted(target.glob(f"llama_cpp_python-{version}.tar.gz"))
    if result.returncode != 0 or not found:
        _fail(f"cannot get the llama-cpp-python {version} sdist from pip; download it "
              f"(pip download --no-deps llama-cpp-python=={version}) and pass --sdist PATH")
    return found[0]


def _extract(sdist: Path, destination: Path) -> None:
    """Unpack the sdist's vendor/llama.cpp into `destination`, atomically (a rename of a finished tree)."""
    if (destination / "CMakeLists.txt").is_file():
        return
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=destination.parent, prefix=".extract-") as scratch:
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
            if not any(m.name.endswith("/vendor/llama.cpp/CMakeLists.txt") for m in members):
                _fail(f"{sdist} has no vendor/llama.cpp; pass a llama-cpp-python sdist (.tar.gz), "
                      f"not a wheel")
            archive.extractall(scratch, members=members, filter="data")
        source = next(Path(scratch).glob("*/vendor/llama.cpp"))
        shutil.rmtree(destination, ignore_errors=True)
        source.rename(destination)


def build(version: str = DEFAULT_VERSION, sdist: str | None = None, jobs: int | None = None,
          force: bool = False) -> Path:
    """Build (or find) llama.cpp's binaries for `version`; returns their directory."""
    root = cache_root() / version
    if built(version) and not force:
        return bin_dir(version)
    cmake, compiler, generator = _find_tools()
    (root / "build.json").unlink(missing_ok=True)  # a rebuild stopped halfway is no finished build
    archive = _find_sdist(sdist, version, cache_root())
    source = root / "src"
    _extract(archive, source)
    build_dir = root / "build"
    jobs = jobs or os.cpu_count() or 1
    start = time.monotonic()
    configure = [cmake, "-S", str(source), "-B", str(build_dir), "-G", generator,
                 f"-DCMAKE_CXX_COMPILER={compiler}", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
                 "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                 "-DLLAMA_OPENSSL=OFF"]
    compile_ = [cmake, "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
                "--target", *TARGETS]
    for step in (configure, compile_):
        print("+", " ".join(step), flush=True)
        if subprocess.run(step).returncode != 0:
            _fail(f"`{' '.join(step[:3])} ...` failed (output above); fix it and rerun, or pass --force")
    destination = bin_dir(version)
    destination.mkdir(parents=True, exist_ok=True)
    for target in TARGETS:
        found = [p for p in build_dir.rglob(target) if p.is_file() and os.access(p, os.X_OK)]
        if not found:
            _fail(f"the build produced no {target}; rerun with --force")
        shutil.copy2(found[0], destination / target)
    stamp = {"version": version, "sdist": str(archive), "targets": list(TARGETS), "jobs": jobs,
             "seconds": round(time.monotonic() - start, 1), "compiler": compiler, "generator": generator}
    # The stamp is written last, so an interrupted build is never taken for a finished one.
    write_json_atomic(root / "build.json", stamp)
    return destination


def main() -> None:
    """Parse the command line, build, print the bin directory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=DEFAULT_VERSION, help="the llama-cpp-python version to build")
    parser.add_argument("--sdist", help="the llama_cpp_python-VERSION.tar.gz (default: ask pip for it)")
    parser.add_argument("--jobs", type=int, help="parallel compile jobs (default: all cores)")
    parser.add_argument("--force", action="store_true", help="rebuild even when a finished build exists")
    parser.add_argument("--print-dir", action="store_true",
                        help="print the bin directory of a finished build (exit 1 if none); build nothing")
    args = parser.parse_args()
    if args.print_dir:
        if not built(args.version):
            _fail(f"no finished build of {args.version}; run tools/build_llama_cpp.py")
        print(bin_dir(args.version))
        return
    print(build(args.version, args.sdist, args.jobs, args.force))


if __name__ == "__main__":
    main()
