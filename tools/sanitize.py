"""Run the native tests against an AddressSanitizer + UBSan build of cflow._native.

    python tools/sanitize.py                  # the native test files (NATIVE_TESTS below)
    python tools/sanitize.py tests/x.py -k y  # other pytest arguments instead

CI runs it after the main test command (.ci/run). What it does, leaving the installed cflow (an
editable install included) untouched:

1. configures CMakeLists.txt with -DCFLOW_SANITIZE=ON into build/sanitize (kept, so a second run
   rebuilds only what changed) and builds the extension there;
2. copies src/cflow into a temporary directory and puts the sanitized _native beside it;
3. runs pytest in a child process whose PYTHONPATH starts with that copy, with the ASan runtime
   and libstdc++ in LD_PRELOAD (Python itself is not instrumented, so the runtime must be
   loaded first, and libstdc++ with it for ASan's C++ exception interceptors), and with a
   sitecustomize.py that drops an editable install's import hook, which would otherwise serve
   `cflow` from the source tree ahead of PYTHONPATH. Before the tests it checks that
   cflow._native is the sanitized copy.

Any sanitizer report aborts the child (the build uses -fno-sanitize-recover), so a finding fails
the run; the exit status is pytest's. Leak detection is off: CPython leaks by design at exit.
Needs cmake and nanobind importable in this Python (`pip install nanobind cmake`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD_DIR = ROOT / "build" / "sanitize"
NATIVE_TESTS = ["tests/test_native_kernels.py", "tests/test_threadpool.py", "tests/test_native_contract.py",
                "tests/test_engine.py", "tests/test_experts_disk.py", "tests/test_kquant_kernels.py",
                "tests/test_expert_speculation.py", "tests/test_attention_block.py", "tests/test_avx512.py"]
# allocator_may_return_null: the engine's "out of memory" paths expect calloc to fail, not ASan to
# abort. abort_on_error: die of SIGABRT, so pytest's faulthandler prints the Python stack (which
# test) after the report.
ASAN_OPTIONS = "detect_leaks=0:allocator_may_return_null=1:halt_on_error=1:abort_on_error=1"
UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1:abort_on_error=1"

SITECUSTOMIZE = '''\
# Written by tools/sanitize.py. An editable install puts an import hook first on sys.meta_path
# that serves `cflow` from the source tree; drop it so `cflow` comes from this directory.
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
'''


def fail(msg: str) -> None:
    print(f"sanitize: {msg}", file=sys.stderr)
    sys.exit(2)


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    if subprocess.run(cmd, **kw).returncode:
        fail(f"{cmd[0]} failed")


def build() -> Path:
    """Configure (once) and build the sanitized extension; returns the .so."""
    cmake = shutil.which("cmake")
    if cmake is None:
        fail("cmake is not on PATH (pip install cmake)")
    try:
        import nanobind  # noqa: F401  (CMakeLists.txt asks this Python for nanobind's CMake dir)
    except ImportError:
        fail(f"nanobind is not importable by {sys.executable} (pip install nanobind)")
    if not (BUILD_DIR / "CMakeCache.txt").exists():
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        run([cmake, "-S", str(ROOT), "-B", str(BUILD_DIR), *gen, "-DCFLOW_SANITIZE=ON", "-DCMAKE_BUILD_TYPE=Release",
             f"-DPython_EXECUTABLE={sys.executable}"])
    run([cmake, "--build", str(BUILD_DIR), "--target", "_native", "-j", str(os.cpu_count() or 1)])
    sos = sorted(BUILD_DIR.glob("_native*.so"))
    if len(sos) != 1:
        fail(f"expected one _native*.so in {BUILD_DIR}, found {[p.name for p in sos]}")
    return sos[0]


def runtime_libs() -> list[str]:
    """The ASan runtime and libstdc++ of the compiler CMake used, resolved to real files."""
    cache = (BUILD_DIR / "CMakeCache.txt").read_text()
    cxx = next((line.split("=", 1)[1] for line in cache.splitlines() if line.startswith("CMAKE_CXX_COMPILER:")), "c++")
    libs = []
    for name in ("libasan.so", "libstdc++.so"):
        out = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        path = os.path.realpath(out) if os.path.isabs(out) else ""
        if not os.path.isfile(path):
            fail(f"{cxx} does not know where {name} is (got {out!r}); the sanitizer build needs GCC's runtime")
        libs.append(path)
    return libs


def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    so = build()
    preload = runtime_libs()
    with tempfile.TemporaryDirectory(prefix="cflow-asan-") as tmp:
        pkg = Path(tmp) / "cflow"
        shutil.copytree(ROOT / "src" / "cflow", pkg, ignore=shutil.ignore_patterns("__pycache__", "_native*.so"))
        shutil.copy2(so, pkg / so.name)
        (Path(tmp) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([tmp] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["LD_PRELOAD"] = " ".join(preload + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
        env["ASAN_OPTIONS"] = ASAN_OPTIONS
        env["UBSAN_OPTIONS"] = UBSAN_OPTIONS
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        where = subprocess.run([sys.executable, "-c", "import cflow._native as n; print(n.__file__)"], env=env,
                               capture_output=True, text=True)
        got = where.stdout.strip()
        if where.returncode or os.path.realpath(got) != os.path.realpath(pkg / so.name):
            fail(f"the child imports cflow._native from {got or '(nowhere)'}, not the sanitized copy "
                 f"{pkg / so.name}\n{where.stderr}")
        print(f"sanitize: cflow._native = {got}", flush=True)
        # --capture=sys: pytest captures sys.stdout/err only, so a report written to fd 2 by a
        # process that then dies reaches the log (fd capture would swallow it with the process)
        cmd = [sys.executable, "-m", "pytest", "-q", "--capture=sys", "-p", "no:cacheprovider", *(argv or NATIVE_TESTS)]
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    if rc < 0:
        print(f"sanitize: pytest died of signal {-rc} (a sanitizer report above?)", file=sys.stderr)
    print(f"sanitize: {'passed' if rc == 0 else 'FAILED'} in {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
