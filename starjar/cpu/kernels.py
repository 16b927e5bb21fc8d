"""Which CPU this is, and which int8 kernel its multi-row draft passes use (chosen by measurement).

A kernel that is fast on one instruction set can be a cliff on another: `torch._int_mm` runs a oneDNN
VNNI/AMX kernel where the CPU has them, and a generic loop about 20-70x slower than fp32 where it does not
(AVX2-only AMD EPYC: 24 ms for a 32 x 576 x 1536 product that fbgemm's fused dynamic kernel does in 0.3 ms).
So the path is not assumed: both candidates are timed once per machine on the model's own shapes, the
fastest is kept in a small JSON cache (keyed by CPU model, capability, torch version, threads and starjar's
own kernels' sources), and
`STARJAR_INT8_KERNEL=int_mm|fused` forces one (tests force each; `auto` is the default).

Both paths give every row (token) its own activation scale, so a row's output does not depend on the rest
of its pass:
  int_mm  rows quantized symmetrically to 8 bits, multiplied with torch._int_mm;
  fused   each row divided by its absolute maximum, then fbgemm/oneDNN's fused dynamic linear (one
          asymmetric range for the pass, which after the division is every row's own range), then
          multiplied back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

INT8_PATHS = ("int_mm", "fused")
ENV = "STARJAR_INT8_KERNEL"
# Settings that make the libraries behave as on a smaller CPU (scripts/emulate_isa.sh): the ISA each one may
# use, and STARJAR_INT_MM_ONEDNN=0, which sends torch._int_mm to its generic loop as on an AVX2-only AMD EPYC.
# A measurement taken under them is another machine's: they are part of every cache key and benchmark meta.
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS", "MKL_ENABLE_INSTRUCTIONS",
              "STARJAR_INT_MM_ONEDNN")
PROBE_ROWS = (2, 8, 32)  # multi-row passes: catch-up, batched drafting, prefill chunks


@lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa_limits() -> dict:
    """The ISA_LIMITS this process runs under (empty on a machine used as it is; STARJAR_INT_MM_ONEDNN only when
    it turns oneDNN off). Values are upper-cased: avx2 and AVX2 are one limit."""
    limits = {k: os.environ[k].strip().upper() for k in ISA_LIMITS if os.environ.get(k, "").strip()}
    if int_mm_uses_onednn():
        limits.pop("STARJAR_INT_MM_ONEDNN", None)
    return limits


def int_mm_uses_onednn() -> bool:
    """False under STARJAR_INT_MM_ONEDNN=0: torch._int_mm then runs the generic kernel a CPU without a oneDNN
    int8 primitive gets (35-50x slower than fp32), so the cliff can be measured on any machine."""
    return os.environ.get("STARJAR_INT_MM_ONEDNN", "1").strip() != "0"


def machine_label() -> str:
    limits = isa_limits()
    emulated = f" (limited: {', '.join(f'{k}={v}' for k, v in limits.items())})" if limits else ""
    return f"{cpu_model()}, {torch.backends.cpu.get_cpu_capability()}, {compute_threads()} threads{emulated}"


def forced_path() -> str | None:
    """The path named by STARJAR_INT8_KERNEL, or None for measurement (auto)."""
    return forced_choice(ENV, INT8_PATHS)


def forced_choice(env: str, choices: tuple[str, ...]) -> str | None:
    """The kernel path an environment variable forces, or None for measurement (unset or auto)."""
    name = os.environ.get(env, "auto").strip().lower()
    if name in ("", "auto"):
        return None
    if name not in choices:
        raise ValueError(f"{env} must be auto or one of {choices}, got {name!r}")
    return name


def forced_switch(env: str) -> bool | None:
    """What a 0/1 environment variable forces: True, False, or None for measurement (unset or auto)."""
    name = forced_choice(env, ("0", "1"))
    return None if name is None else name == "1"


_chosen: dict[tuple, str] = {}
_entries: dict[str, dict] = {}  # cached_entry's, by name, for this process


def cached_entries() -> dict[str, dict]:
    """The choices cached_entry made or read in this process, by name."""
    return dict(_entries)


def chosen_path(shapes: tuple[tuple[int, int], ...], measure: Callable[[tuple], dict[str, float]]) -> str:
    """The int8 path for multi-row passes on this machine: forced, cached, or measured now by measure(shapes)
    (ms per path; starjar.cpu.quantized.time_paths, about 1 s)."""
    forced = forced_path()
    if forced is not None:
        return forced
    key = (_machine_key(), tuple(shapes))
    if key in _chosen:
        return _chosen[key]
    cache = _cache_file()
    stored = _read(cache)
    entry = stored.get(_entry_name(key))
    if entry and entry.get("path") in INT8_PATHS:
        _chosen[key] = entry["path"]
        return entry["path"]
    timings = measure(shapes)
    best = min(timings, key=timings.get)
    _chosen[key] = best
    stored[_entry_name(key)] = {"path": best, "ms": {k: round(v, 4) for k, v in timings.items()},
                                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    _write(cache, stored)
    log.info("int8 kernel for multi-row passes: %s (%s; %s)", best,
             ", ".join(f"{k} {v:.3f} ms" for k, v in timings.items()), machine_label())
    return best


def cached_entry(kind: str, shapes: tuple[tuple[int, int], ...], measure: Callable[[], dict],
                 usable: Callable[[dict], bool] = lambda entry: True) -> dict:
    """A per-machine measurement of `kind` for these layer shapes, kept in the kernel cache: read when there
    (and usable), else measured now (measure() returns a JSON-able dict) and saved."""
    name = f"{_machine_key()}|{kind}|" + ",".join(f"{k}x{n}" for k, n in shapes)
    if name in _entries and usable(_entries[name]):  # another model of these shapes may have made it unusable here
        return _entries[name]
    cache = _cache_file()
    entry = _read(cache).get(name)
    if not isinstance(entry, dict) or not usable(entry):
        entry = {**measure(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        stored = _read(cache)  # read again: another process may have saved its own entry meanwhile
        stored[name] = entry
        _write(cache, stored)
    _entries[name] = entry
    return entry


def interleaved_times(fns: list[Callable[[], object]], reps: int) -> list[list[float]]:
    """Seconds of each function per repeat (each run once first), run in turns so that a slow spell hits all."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return times


def interleaved_medians(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Median seconds of each function over interleaved_times' repeats."""
    return [statistics.median(t) for t in interleaved_times(fns, reps)]


def _machine_key() -> str:
    limits = "".join(f"|{k}={v}" for k, v in isa_limits().items())
    return f"{cpu_model()}|{torch.backends.cpu.get_cpu_capability()}|torch {torch.__version__}|" \
           f"{compute_threads()} threads|{torch.backends.quantized.engine}{limits}|native {native_digest()}"


@lru_cache(maxsize=1)
def native_digest() -> str:
    """A digest of starjar's own kernels' sources: a choice measured against other kernels is measured again."""
    root = Path(__file__).resolve().parent.parent
    files = sorted(f for d in (root / "cpu" / "native", root / "model" / "native") for f in d.glob("*.[ch]*"))
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]


def _entry_name(key: tuple) -> str:
    machine, shapes = key
    return f"{machine}|" + ",".join(f"{k}x{n}" for k, n in shapes)


def _cache_file() -> Path:
    root = os.environ.get("STARJAR_HOME") or Path.home() / ".cache" / "starjar"
    return Path(root) / "kernels.json"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as exc:  # a read-only home only costs a re-measurement next time
        log.warning("could not save the kernel choice to %s: %s", path, exc)


_compute_threads: int | None = None  # set when a process's main thread hands its threads to compute threads


def compute_threads() -> int:
    """The thread count this process computes with: what the main thread had before handing it over."""
    return _compute_threads or torch.get_num_threads()


def adopt_thread_count() -> None:
    """Give the calling thread torch's thread count. OpenMP keeps the count per thread: torch.set_num_threads()
    holds for the thread that called it, and a thread started later takes OMP_NUM_THREADS from the environment
    (Ray sets 1 in its workers), while torch.get_num_threads() still reports the set count. Measured on a
    2-core AMD EPYC with OMP_NUM_THREADS=1: a 2000 x 2000 matmul 92 ms on the main thread, 173 ms on a new one,
    92 ms there after this call. Engine and draft compute threads call it first."""
    torch.set_num_threads(compute_threads())


def hand_threads_to_compute() -> bool:
    """For a process that computes on threads of its own (a server's engine or draft compute thread), called on
    the thread that loaded the models: it releases its OpenMP team and runs torch ops on one thread from now on;
    compute threads adopt the count it had. Returns whether the team was released.

    Why: GNU OpenMP lets a team's idle threads spin between parallel regions only while it manages no more
    threads than there are CPUs; past that it sleeps them at once, and every op of the next pass pays a
    futex wake-up. The loading thread's idle team counted: on a 2-core Intel Xeon (AVX-512, AMX), a draft
    round (catch-up and one step, gamma 2) took 48.9 ms on a compute thread next to it and 17.8 ms without it
    (18.5 ms on the main thread alone); a batch-1 draft server's rounds took 44 ms against 19.6 ms in-process.
    """
    global _compute_threads
    if _compute_threads is None:
        _compute_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pause = _omp_pause_resource_all()
    if pause is None:
        log.info("no GNU OpenMP runtime found to release the loading thread's team (its threads stay idle)")
        return False
    return pause(1) == 0  # omp_pause_soft: frees the calling thread's idle team


def _omp_pause_resource_all():
    """libgomp's omp_pause_resource_all from the copy this process loaded (torch's), or None."""
    import ctypes

    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = list(dict.fromkeys(line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]))
    torch_dir = str(Path(torch.__file__).parent)
    paths.sort(key=lambda p: not p.startswith(torch_dir))  # torch's own copy first: the one its ops run on
    for path in paths:
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None
