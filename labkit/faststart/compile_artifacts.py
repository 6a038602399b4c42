"""torch.compile's work saved once per card and torch version, and loaded before compiling again.

    labkit compile-cache                          # where this machine's artifact lives, and whether it is usable
    labkit compile-cache --build                  # compile the ladder's compiled rungs' first steps, save the artifact

A cold torch.compile of the top rung takes tens of seconds, most of a 5-epoch run. Everything it compiles (the
graphs, their generated kernels, autotuning choices) lands in inductor's cache folder, which a fresh machine (a
new Colab session) does not have. `torch.compiler.save_cache_artifacts` packs what this process compiled into
one portable blob; `load_cache_artifacts` writes such a blob into the cache folder of another process, whose
compile then reads its results back instead of compiling. The blob only fits the card and torch version that
made it, so it is stored in a file named for both (`artifact_path`) with a header naming them again and a
checksum of the blob. `labkit ladder` and `labkit train` load it when it exists (`--no-compile-cache`: don't).
On a CUDA GPU the compiled Triton kernels travel inside the blob (inductor bundles them into its graph cache);
on a CPU only the graphs do, and their C++ kernels are compiled again, so there the artifact saves little.
A restored kernel looks for its autotuning choice in the folder it was compiled in on the building machine, so
the load copies the artifact's choices there too (`place_autotune_results`).
When the artifact was built for every graph a command compiles, inductor compiles in the process instead of
starting its pool of compile workers, which would have nothing to compile and would hold up the exit
(`TORCHINDUCTOR_COMPILE_THREADS=N` keeps N workers).

The build also saves each compiled rung's forward whole, dynamo's trace included (`labkit.faststart.precompiled`), which
`labkit train` runs instead of torch.compile where it fits.
Whatever goes wrong falls back to compiling as if there were no artifact, with one line saying why: a file that
cannot be read, one built for another card or torch (stale), one whose bytes do not check out (corrupt), a
cache folder that cannot be written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from labkit.bench import unwritable
from labkit.env import git_commit, gpu_facts

MAGIC = b"labkit compile cache v1\n"  # then one line of JSON (the header), then the blob
SUFFIX = ".compile-cache"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def card(device: torch.device | str) -> str:
    """What compiled code depends on besides torch: the GPU model and compute capability, or the CPU's ISA."""
    dev = torch.device(device)
    if dev.type == "cuda":
        facts = gpu_facts(dev)
        return f"{facts.name} sm{facts.capability[0]}{facts.capability[1]}"
    return f"cpu {platform.machine()} {torch.backends.cpu.get_cpu_capability()}"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.+]+", "-", text.lower()).strip("-")


def default_folder() -> Path:
    """Where artifacts are kept: $LABKIT_COMPILE_CACHE, else ~/.cache/labkit/compile-cache."""
    return Path(os.environ.get("LABKIT_COMPILE_CACHE") or Path.home() / ".cache" / "labkit" / "compile-cache")


def artifact_stem(device: torch.device | str) -> str:
    """The card and torch version in a file name, e.g. nvidia-h100-80gb-hbm3-sm90-torch2.11.0+cu130."""
    return f"{_slug(card(device))}-torch{_slug(torch.__version__)}"


def artifact_path(device: torch.device | str, folder: str | os.PathLike | None = None) -> Path:
    """The artifact file for this card and torch version, e.g. nvidia-h100-80gb-hbm3-sm90-torch2.11.0+cu130.compile-cache."""
    return Path(folder or default_folder()) / f"{artifact_stem(device)}{SUFFIX}"


def _unpack(blob: bytes, magic: bytes = MAGIC) -> tuple[dict, bytes]:
    """(header, payload) of an artifact file; ValueError naming what is wrong."""
    if not blob.startswith(magic):
        raise ValueError("not a labkit compile cache")
    line, sep, payload = blob[len(magic):].partition(b"\n")
    if not sep:
        raise ValueError("header cut short")
    try:
        header = json.loads(line)
    except ValueError:
        raise ValueError("header is not JSON") from None
    if not isinstance(header, dict) or not {"card", "torch", "sha256", "bytes"} <= header.keys():
        raise ValueError("header lacks card, torch, sha256 or bytes")
    if len(payload) != header["bytes"] or hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise ValueError(f"{len(payload):,} bytes that do not match the checksum of the {header['bytes']:,} written")
    return header, payload


def check(device: torch.device | str, folder: str | os.PathLike | None = None) -> tuple[str, str, dict | None]:
    """(state, why, header) of this machine's artifact without loading it.

    state: "absent", "unreadable", "corrupt", "stale" (built for another card or torch) or "ok"; for "absent",
    `why` names artifacts of the same card for other torch versions, if any.
    """
    path = artifact_path(device, folder)
    if not path.exists():
        mine = _slug(card(device)) + "-torch"
        others = sorted(p.name for p in path.parent.glob(f"{mine}*{SUFFIX}")) if path.parent.is_dir() else []
        return "absent", (f"only {', '.join(others)} (other torch versions)" if others else ""), None
    try:
        blob = path.read_bytes()
    except OSError as e:
        return "unreadable", e.strerror or str(e), None
    try:
        header, _ = _unpack(blob)
    except ValueError as e:
        return "corrupt", str(e), None
    want = {"card": card(device), "torch": torch.__version__}
    wrong = [f"{k} {header[k]!r}, not {v!r}" for k, v in want.items() if header[k] != v]
    if wrong:
        return "stale", "built for " + " and ".join(wrong), header
    return "ok", "", header


@contextlib.contextmanager
def _quiet(name: str):
    # torch logs a failed unpickle with its traceback; the one line below says it instead
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _inductor_cache_folder() -> str:
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if folder:
        return os.path.abspath(folder)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


def load(device: torch.device | str, folder: str | os.PathLike | None = None, *, say=_say,
         graphs: list[dict] | None = None) -> dict | None:
    """Load this card's and torch version's artifact into torch.compile's cache folder, when there is one.

    Returns {"path", "bytes", "entries", "built", "compile_workers"} when loaded (entries: cached graphs and
    kernels per kind; one line says so), else None: no artifact (silent unless one exists for another torch
    version), or one that is unreadable, stale or corrupt, or a cache folder that cannot be written (one line
    each; torch.compile then compiles as usual, into a fresh temporary folder if its own cannot be written).
    `graphs`: what the caller will compile (`labkit.train.graph_key` of each config); when the artifact was
    built for all of them, inductor compiles in the process instead of starting compile workers.
    """
    path = artifact_path(device, folder)
    state, why, header = check(device, folder)
    if state == "absent":
        if why:
            say(f"compile cache: none for {card(device)}, torch {torch.__version__} in {path.parent} ({why}): "
                f"compiling from scratch")
        return None
    if state != "ok":
        say(f"compile cache {path} is {state} ({why}): compiling from scratch")
        return None
    cache = _inductor_cache_folder()
    bad = unwritable(cache)
    if bad:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp = tempfile.mkdtemp(prefix="labkit-inductor-")
        say(f"compile cache: torch.compile's cache folder {cache} cannot be written ({bad}): compiling from "
            f"scratch in {tmp}")
        return None
    fn = getattr(torch.compiler, "load_cache_artifacts", None)
    if fn is None:
        say(f"compile cache: torch {torch.__version__} cannot load portable caches (torch 2.7+ can): "
            f"compiling from scratch")
        return None
    _, payload = _unpack(path.read_bytes())
    try:
        with _quiet("torch.compiler._cache"):
            info = fn(payload)
    except OSError as e:
        say(f"compile cache: writing {path.name} into {cache} failed ({e.strerror or e}): compiling from scratch")
        return None
    except Exception as e:  # noqa: BLE001 - any failure inside torch's loader means: compile instead
        say(f"compile cache {path} is corrupt (torch could not load it: {type(e).__name__}): compiling from scratch")
        return None
    if info is None:
        say(f"compile cache {path} is corrupt (torch could not unpack it): compiling from scratch")
        return None
    entries = {k: len(v) for k, v in info.artifacts.items()}
    note = header.get("note") or {}
    placed = place_autotune_results(info.artifacts.get("autotune", []), cache, note.get("kernels_in"))
    built_for = note.get("graphs") or []
    workers = not (graphs and all(g in built_for for g in graphs)) or _keep_compile_workers()
    say(f"compile cache: loaded {sum(entries.values())} cached graphs and kernels from {path}"
        + ("" if workers else " (compiling in this process: TORCHINDUCTOR_COMPILE_THREADS=N starts N workers)"))
    return {"path": str(path), "bytes": len(payload), "entries": entries, "built": header.get("built"),
            "compile_workers": workers, "autotune_placed": placed}


# An autotune entry's key: the kernel's folder (two characters of its hash) and the result's file name.
_AUTOTUNE_KEY = re.compile(r"[A-Za-z0-9_]{1,8}/[A-Za-z0-9_]{1,128}\.best_config")


def place_autotune_results(keys: list[str], cache: str, kernels_in: str | None) -> int:
    """Copy the artifact's autotuning results (written under `cache`) to where its kernels look for them.

    torch 2.11 restores a cached Triton kernel with the path it was compiled at, on the machine that built the
    artifact (`kernels_in`, recorded by the build), and reads the kernel's autotuning result from that kernel's
    folder. Under this machine's cache folder the result is never found, so the first step timed every
    kernel's launch configs again, seconds of it. Returns how many were placed; none where that folder cannot
    be written (the kernels then time their configs, as before).
    """
    if not kernels_in or not os.path.isabs(kernels_in) or os.path.abspath(kernels_in) == os.path.abspath(cache):
        return 0
    placed = 0
    for key in keys:
        if not _AUTOTUNE_KEY.fullmatch(key):  # a path from the file: only ever a folder and a name below
            continue
        try:
            result = (Path(cache) / key).read_bytes()
        except OSError:
            continue  # not written here: that kernel times its configs, the others still get theirs
        dst = Path(kernels_in) / key
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(result)
        except OSError:
            break  # the folder cannot be written: nor can it for the rest
        placed += 1
    return placed


def _keep_compile_workers() -> bool:
    """For a run the artifact covers: compile in this process unless TORCHINDUCTOR_COMPILE_THREADS says
    otherwise; returns whether inductor keeps its worker pool.

    With every graph and kernel in the artifact there is nothing for inductor's compile workers (one process per
    core, each importing torch) to do, yet torch.compile still starts them and hands them the cached kernels to
    load: they compete with the first step for the CPU, and the process waits seconds at exit for the pool to shut
    down (cold_start_workers.json). A graph the artifact lacks would compile in one thread, more slowly, which is
    why a run it does not cover keeps the pool.
    """
    if os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"):
        return True
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    return False


def save(device: torch.device | str, folder: str | os.PathLike | None = None, *, note: dict | None = None,
         say=_say) -> Path | None:
    """Write everything torch.compile compiled (or read from its cache) in this process as this card's and
    torch version's artifact, replacing any older one; returns its path, or None with one line saying why not
    (nothing compiled, a folder that cannot be written). `note` (e.g. the rungs compiled) goes into the header."""
    fn = getattr(torch.compiler, "save_cache_artifacts", None)
    if fn is None:
        say(f"compile cache: torch {torch.__version__} cannot save portable caches (torch 2.7+ can)")
        return None
    got = fn()
    if got is None:
        say("compile cache: nothing was compiled in this process, so there is nothing to save")
        return None
    payload, info = got
    path = artifact_path(device, folder)
    header = {"card": card(device), "torch": torch.__version__, "bytes": len(payload),
              "sha256": hashlib.sha256(payload).hexdigest(), "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "git_commit": git_commit(), "entries": {k: len(v) for k, v in info.artifacts.items()},
              "note": note or {}}
    return _write(path, MAGIC, header, payload, say)


def _write(path: Path, magic: bytes, header: dict, payload: bytes, say) -> Path | None:
    """Write magic, the header line and the payload to `path` atomically (a reader never sees half a file);
    None with one line saying why when the folder cannot be written."""
    bad = unwritable(path.parent)
    if bad:
        say(f"compile cache: {path.parent} cannot be written ({bad}): no artifact saved")
        return None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(magic + json.dumps(header).encode() + b"\n" + payload)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        say(f"compile cache: writing {path} failed ({e.strerror or e}): no artifact saved")
        return None
    return path


def add_flag(parser) -> None:
    """The --no-compile-cache switch of the commands that load the artifact before training."""
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="don't load the saved torch.compile artifact (labkit compile-cache): compile from scratch "
                             "before the first step")


def load_for_cli(args, device, graphs: list[dict]) -> dict | None:
    """The training commands' hook: load the artifact unless --no-compile-cache or nothing will compile
    (`graphs`: `labkit.train.graph_key` of each compiled config the command runs)."""
    if not graphs or getattr(args, "no_compile_cache", False):
        return None
    return load(device, graphs=graphs)
