"""The sandbox a student's code runs in: bubblewrap namespaces with a whitelist view of the machine.

Policy (one place, used for the notebook kernel and for the student side of every check):
- own PID namespace: nothing outside is visible or signalable (the grader, other students, their kernels),
  and every process inside dies with the namespace's first process, however it detached (double fork, setsid);
- own network, IPC and UTS namespaces: no network at all, no shared memory or sockets with anyone outside;
- an unprivileged user (uid/gid 65534) with every capability dropped;
- a read-only whitelist of the filesystem: the system directories, the Python installation and its
  environment, `labkit`, and the public half of the grader (`autograder/student`, see PUBLIC below). Not the
  repository, the course, the submissions, other students or the grader's output;
- one writable folder (the student's own scratch folder) and a private /tmp;
- one GPU passed through for GPU labs (`gpu=N`), nothing else of /dev beyond the basic nodes.
Memory, wall-clock, process-count and disk limits (`autograder.sandbox.disk_cap`) are enforced from outside by
`autograder.sandbox.limits` and `autograder.sandbox.remote`, which also freezes (SIGSTOP) the whole sandbox while a baseline is
being timed.

Bubblewrap is the tool made for this (Flatpak's sandbox): no daemon, no root needed where unprivileged user
namespaces are allowed. Where it is missing the grader refuses to start unless the instructor says the
submissions are trusted (`--trusted-submissions`), and then `command()` is the plain command.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from autograder.sandbox.disk_cap import DISK_BYTES, MAX_FILES, DiskWatch

GRADER_ROOT = Path(__file__).resolve().parents[2]
PUBLIC = GRADER_ROOT / "autograder" / "student"  # the only part of the grader a student process may import
VIEW = "/opt/labkit-grader"  # where the public grader and labkit appear inside the sandbox (on sys.path)
SANDBOX_UID = 65534  # "nobody"
CACHE_VIEW = "/tmp/compile-cache"  # where a sandbox sees its compile caches (the student's own folder, if any)
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "passwd", "group", "nsswitch.conf", "hosts",
        "localtime", "ssl", "ca-certificates", "fonts", "matplotlibrc", "os-release", "mime.types")
_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "TZ", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES",
             "OMP_NUM_THREADS",
             "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
             "NBGRADER_EXECUTION", "TQDM_DISABLE", "PYTHONWARNINGS", "MPLBACKEND", "PYTHONUNBUFFERED",
             "PYTHONDONTWRITEBYTECODE", "LD_LIBRARY_PATH", "TORCHINDUCTOR_COMPILE_THREADS")


class SandboxUnavailable(RuntimeError):
    """No usable sandbox tool on this machine (bubblewrap missing or not allowed to create namespaces)."""


def find_bwrap() -> str | None:
    """Path of the bubblewrap binary, or None."""
    return shutil.which("bwrap")


@dataclass
class Jail:
    """One sandbox: what it shows, what it may write, which GPU it gets."""

    writable: list[Path]  # folders the student's processes may write (their own scratch), bound at the same path
    readable: list[Path] = field(default_factory=list)  # extra read-only folders, bound at the same path
    gpu: int | str | None = None  # host GPU index passed through ("all": every GPU; None: no GPU devices)
    cwd: Path | None = None  # working directory inside (default: the first writable folder)
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables
    trusted: bool = False  # no sandbox at all (the instructor vouched for the submissions)
    cache: Path | None = None  # this student's compile caches, shared by their notebook and runner only (below)
    hide: tuple[str, ...] = ()  # labkit modules left out of the view, and torch files ("torch/...") a stub stands in
                                # for: a lab's answer (autograder.labkit_answers.sandbox_hides)
    disk_bytes: int | None = DISK_BYTES  # space the files in `writable` and `cache` may take together, bytes
    max_files: int | None = MAX_FILES  # files and folders there together

    def disk_watch(self) -> DiskWatch:
        """The watch on what this sandbox writes (autograder.sandbox.disk_cap): its writable folders and its cache."""
        return DiskWatch([*self.writable, *([self.cache] if self.cache is not None else [])], self.disk_bytes,
                         self.max_files)

    def host_env(self, env: dict[str, str]) -> dict[str, str]:
        """The environment to start the sandbox with: bubblewrap's own process stays visible inside (as the PID
        namespace's first process, whose /proc/1/environ a student can read), so it gets nothing of the
        grader's environment; the student's processes get theirs through --setenv."""
        if not self.trusted:
            return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        return {**env, **cache_env(str(self.cache))} if self.cache is not None else dict(env)

    def python_path(self) -> str:
        """PYTHONPATH inside: the grader's public half and labkit, nothing else of the repository."""
        return VIEW if not self.trusted else str(GRADER_ROOT)

    def command(self, cmd: list[str], *, bwrap: str | None = None) -> list[str]:
        """`cmd` wrapped in bubblewrap with this policy (the plain command when trusted)."""
        if self.trusted:
            return list(cmd)
        bwrap = bwrap or find_bwrap()
        if not bwrap:
            raise SandboxUnavailable("bubblewrap (bwrap) is not installed")
        cwd = self.cwd or (self.writable[0] if self.writable else Path("/tmp"))
        args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
                "--proc", "/proc", "--dev", "/dev", *_tmpfs("/tmp", bwrap), *_tmpfs("/dev/shm", bwrap),
                "--hostname", "sandbox", "--clearenv"]
        args += _system_binds()
        for p in _python_roots():
            args += ["--ro-bind", str(p), str(p)]
        args += _grader_view(self.hide)
        for p in self.readable:
            args += ["--ro-bind", str(p), str(p)]
        for p in self.writable:
            args += ["--bind", str(p), str(p)]
        if self.gpu is not None:
            args += _gpu_binds(self.gpu)
        if self.cache is not None:
            args += ["--bind", str(self.cache), CACHE_VIEW]
        env = {k: os.environ[k] for k in _ENV_KEEP if k in os.environ}  # the sandbox's, not bwrap's own
        env.update(HOME="/tmp/home", TMPDIR="/tmp", PYTHONPATH=VIEW, PYTHONNOUSERSITE="1", MPLCONFIGDIR="/tmp/mpl",
                   JUPYTER_RUNTIME_DIR="/tmp/jupyter-runtime", IPYTHONDIR="/tmp/ipython", **cache_env(CACHE_VIEW))
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "/usr/bin:/bin")
        env.update(self.env)
        for k, v in env.items():
            args += ["--setenv", k, v]
        # bubblewrap's root is a tmpfs of no size limit: gigabytes written there belong to no process, so no memory
        # watchdog sees them. Read-only once everything is mounted; /tmp and /dev/shm are capped tmpfs of their own.
        return args + ["--remount-ro", "/", "--chdir", str(cwd), "--", *cmd]


def cache_env(root: str) -> dict[str, str]:
    """Where torch.compile keeps its caches, under `root`.

    A student's notebook and the runner that grades it compile the same step: with one folder for both (the
    student's own, `Jail.cache`, bound at the same path in each sandbox) the runner starts warm, where each
    compiling from scratch cost a GPU lab tens of seconds per student. It is never shared between students,
    nor with the baseline: a cache entry is code that the process loading it runs.
    """
    return {"TORCHINDUCTOR_CACHE_DIR": f"{root}/inductor", "TRITON_CACHE_DIR": f"{root}/triton"}


def _system_binds() -> list[str]:
    """/usr and its merged-usr links, and a few files of /etc (no keys, no host configuration)."""
    out = ["--ro-bind", "/usr", "/usr"]
    for d in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/") / d
        if p.is_symlink():
            out += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            out += ["--ro-bind", str(p), str(p)]
    for name in _ETC:
        p = Path("/etc") / name
        if p.exists():
            out += ["--ro-bind", str(p), str(p)]
    return out


def _python_roots() -> list[Path]:
    """The interpreter's installation and environment, and every site-packages folder on sys.path.

    Paths inside the grader's repository are left out (a virtual environment kept there is bound on its own),
    so a checkout's sources never become visible through a path entry.
    """
    roots: list[Path] = []
    for p in {sys.base_prefix, sys.prefix, *[q for q in sys.path if "site-packages" in q or "dist-packages" in q]}:
        p = Path(p).resolve()
        if not p.is_dir() or p == Path("/") or str(p).startswith(("/usr/", "/proc", "/sys", "/dev")):
            continue
        if _inside(p, GRADER_ROOT) and not _inside(p, Path(sys.prefix).resolve()):
            continue
        roots.append(p)
    roots.sort(key=lambda p: len(p.parts))
    kept: list[Path] = []
    for p in roots:  # a folder already bound covers its children
        if not any(_inside(p, k) for k in kept):
            kept.append(p)
    return kept


def _inside(p: Path, root: Path) -> bool:
    return p == root or root in p.parents


def _grader_view(hide: tuple[str, ...] = ()) -> list[str]:
    """labkit (less the modules in `hide`) and the public half of the grader under VIEW; a kernel-side stub stands
    in for the harness, and autograder.student.no_grad_scaler for the torch files `hide` names."""
    import labkit

    src = Path(labkit.__file__).resolve().parent
    mods = tuple(h for h in hide if not h.startswith("torch/"))
    out = ["--dir", f"{VIEW}/autograder", *(_labkit_without(src, mods) if mods else
                                            ["--ro-bind", str(src), f"{VIEW}/labkit"]),
           *_torch_stubs(tuple(h for h in hide if h.startswith("torch/"))),
           "--ro-bind", str(PUBLIC), f"{VIEW}/autograder/student",
           "--ro-bind", str(PUBLIC / "view_init.py"), f"{VIEW}/autograder/__init__.py",
           "--ro-bind", str(PUBLIC / "kernel_harness.py"), f"{VIEW}/autograder/harness.py",
           "--ro-bind", str(PUBLIC / "kernel_harness.py"), f"{VIEW}/autograder/rehearsal.py",
           # nbgrader runs inside the sandbox with the notebook, and loads the grader's preprocessors from here
           "--ro-bind", str(GRADER_ROOT / "autograder" / "nbhooks.py"), f"{VIEW}/autograder/nbhooks.py"]
    return out


def _torch_stubs(files: tuple[str, ...]) -> list[str]:
    """The stub bound over each torch file in `files` ("torch/amp/grad_scaler.py"), and an empty file over its
    bytecode, which Python then finds invalid and ignores: the real module cannot be loaded from either."""
    if not files:
        return []
    spec = importlib.util.find_spec("torch")  # where it is installed, without importing it here
    if spec is None or not spec.origin:
        return []  # no torch, nothing of it to hide
    root = Path(spec.origin).resolve().parent.parent
    out = []
    for rel in files:
        target = root / rel
        if not target.is_file():
            raise SandboxUnavailable(f"{target}: this torch has no such file to stand in for; the grader's list "
                                     "(autograder.labkit_answers.TORCH_HIDDEN) needs updating for it")
        out += ["--ro-bind", str(PUBLIC / "no_grad_scaler.py"), str(target)]
        for pyc in sorted((target.parent / "__pycache__").glob(f"{target.stem}.*.pyc")):
            out += ["--ro-bind", "/dev/null", str(pyc)]
    return out


def _labkit_without(src: Path, hide: tuple[str, ...]) -> list[str]:
    """labkit bound file by file without the hidden modules (nor their bytecode); an installed copy inside a bound
    Python folder is covered by an empty folder, so no path leads to the hidden files."""
    out = ["--tmpfs", str(src)] if any(_inside(src, r) for r in _python_roots()) else []
    out += ["--dir", f"{VIEW}/labkit", "--dir", f"{VIEW}/labkit/__pycache__"]
    for p in sorted([*src.iterdir(), *(src / "__pycache__").glob("*")]):
        mod = p.name.split(".")[0]
        if mod not in hide and p.name != "__pycache__" and not p.name.startswith("."):
            out += ["--ro-bind", str(p), f"{VIEW}/labkit/{p.relative_to(src).as_posix()}"]
    return out


def visible_gpu() -> int | str | None:
    """The GPU this process may use, from CUDA_VISIBLE_DEVICES: its index, "all" (unset, or named by UUID), or
    None (hidden: "" or "-1")."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "all").split(",")[0].strip()
    if first in ("", "-1"):
        return None
    return int(first) if first.isdigit() else "all"


def _gpu_binds(index: int | str) -> list[str]:
    out = []
    cards = sorted(glob.glob("/dev/nvidia[0-9]*")) if index == "all" else [f"/dev/nvidia{index}"]
    for dev in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset", *cards,
                *glob.glob("/dev/dri/*")]:
        if os.path.exists(dev):
            out += ["--dev-bind", dev, dev]
    # The driver's libraries live under /usr (already bound); CUDA reads the device topology from /sys.
    out += ["--ro-bind", "/sys", "/sys", "--ro-bind-try", "/etc/nvidia", "/etc/nvidia"]
    return out


_PROBED: dict[str, str | None] = {}


TMPFS_BYTES = 1 << 30  # each of the sandbox's /tmp and /dev/shm, bytes: their pages are memory no watchdog counts


def _tmpfs(path: str, bwrap: str) -> list[str]:
    """A private tmpfs at `path`, capped at TMPFS_BYTES where this bubblewrap can (`--size`, 0.8 and later):
    uncapped, each may grow to half the machine's memory, which a hand-in could fill to bring the host's
    out-of-memory killer onto the grader or a classmate."""
    return [*(["--size", str(TMPFS_BYTES)] if _can_size(bwrap) else []), "--tmpfs", path]


def _can_size(bwrap: str) -> bool:
    if bwrap not in _SIZES:
        import subprocess

        try:
            r = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
            _SIZES[bwrap] = "--size" in r.stdout + r.stderr
        except (OSError, subprocess.TimeoutExpired):
            _SIZES[bwrap] = False
    return _SIZES[bwrap]


_SIZES: dict[str, bool] = {}


def probe() -> str | None:
    """None when bubblewrap can build a sandbox here; otherwise why not (one line). Cached per process."""
    if "result" in _PROBED:
        return _PROBED["result"]
    import subprocess

    bwrap = find_bwrap()
    if not bwrap:
        why = "bubblewrap (bwrap) is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    else:
        cmd = Jail(writable=[]).command([sys.executable, "-c", "import os; print(os.getuid(), os.getpid())"],
                                         bwrap=bwrap)
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            ok = r.returncode == 0 and r.stdout.split() == [str(SANDBOX_UID), "2"]
            why = None if ok else f"bubblewrap could not build a sandbox: {(r.stderr.strip() or r.stdout)[-200:]}"
        except (OSError, subprocess.TimeoutExpired) as e:
            why = f"bubblewrap could not build a sandbox: {e}"
    _PROBED["result"] = why
    return why
