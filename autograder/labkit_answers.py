"""No free answers from labkit: the labkit modules that implement a lab's answer, kept away from its submissions.

labkit is the course's own library, and some of its modules are a lab's answer in finished form (lab 1's
scalers are `labkit.loss_scaling`). A submission of that lab must not use them. Two layers:

- the sandbox's view of labkit leaves those modules out (autograder.sandbox.jail, `Jail.hide`): however the student's
  code asks for one (import, importlib, __import__, exec of a string, sys.modules, opening the file and exec'ing
  it), there is nothing to find, and its checks fail;
- before any check runs, `banned_uses` reads the submission (its syntax tree: imports, attribute access on
  labkit, strings naming the module) so the usual ways fail at once with one clear message.

Lab 1 also bans torch's own GradScaler, in the same two layers: the reader (`TORCH_BANNED`), and in the sandbox
a stub that stands in for torch's grad-scaler modules (`TORCH_HIDDEN`, autograder.student.no_grad_scaler), since
torch itself has to stay.
The lists are stated in each lab's instructions (the notebooks' first cell; a test keeps the two in step).
Modules the probes need (bench, env, outputs, errors, models) are never on them.
"""

from __future__ import annotations

import ast
import re

# lab -> labkit modules that implement (part of) its answer
BANNED: dict[str, tuple[str, ...]] = {
    # the scalers themselves; amp re-exports them and its AmpTrainer runs the fp16 + scaler step
    "lab1": ("loss_scaling", "amp"),
    # packed storage and batched augmentation (data, loaders, loader_bench), the bucketing sampler (bucketing),
    # the training engine's device-resident batches with batched augmentation (train)
    "lab2": ("data", "loaders", "loader_bench", "bucketing", "train"),
    # the answer is a finding about your own slow_train.py and a loop to write; labkit's profilers are the tools
    # the lab asks for (in the notebook), and scenarios' fixed workloads are other programs than slow_train.py
    "lab3": (),
    # the ladder's engine: channels_last, autocast, torch.compile, fused optimizers, CUDA graphs, in one step
    # (train; ddp, faststart (its cold start: the compile-cache artifact, the tiered start) and profiling drive
    # it), and amp's training step. faststart is a package: banned whole, its files are never in the sandbox
    "lab4": ("train", "amp", "ddp", "faststart", "profiling"),
    # week 7's Triton kernels and their checks (a fused kernel of another operation, and how to write one)
    "lab5": ("week7_exercises",),
}


# lab -> torch names that are its answer, named in its instructions ("without `torch.amp.GradScaler`"): a wrapper
# around GradScaler passed every scaler check of lab 1, and so did a scaler made of the two kernels GradScaler calls.
# {a name in code: what it reaches}. The class and its module count on a path from torch (an honest scaler may well
# keep a `grad_scaler` of its own); the kernels' names are torch's alone and count wherever they appear in code,
# their out-of-place forms (torch.ops.aten._amp_update_scale) included.
TORCH_BANNED: dict[str, dict[str, str]] = {
    "lab1": {"GradScaler": "torch.amp.GradScaler", "grad_scaler": "torch.amp.GradScaler",
             "_amp_foreach_non_finite_check_and_unscale_": "torch._amp_foreach_non_finite_check_and_unscale_",
             "_amp_update_scale_": "torch._amp_update_scale_"},
    # lab 5's kernel is the softmax family written by hand: torch's own ops for it are the answer
    "lab5": {"cross_entropy": "torch.nn.functional.cross_entropy", "CrossEntropyLoss": "torch.nn.CrossEntropyLoss",
             "log_softmax": "torch.log_softmax", "softmax": "torch.softmax", "logsumexp": "torch.logsumexp",
             "nll_loss": "torch.nn.functional.nll_loss", "NLLLoss": "torch.nn.NLLLoss",
             "LogSoftmax": "torch.nn.LogSoftmax", "Softmax": "torch.nn.Softmax"},
}
# lab -> TORCH_BANNED names that also count as a method of any object (logits.softmax(1)), or as a whole string
# (getattr(x, "softmax")), except off triton (tl.softmax is a Triton op inside the student's own kernel). The
# probes see these ops at torch's dispatcher however they are reached (autograder.student.lab5.torch_ops_seen).
TORCH_METHODS: dict[str, tuple[str, ...]] = {"lab5": ("cross_entropy", "log_softmax", "softmax", "logsumexp",
                                                      "nll_loss")}
# lab -> torch files (from the site-packages folder) its sandbox shows as autograder.student.no_grad_scaler, so that
# the class is not there to reach however the name is built (the reader above gives the clear message first)
TORCH_HIDDEN: dict[str, tuple[str, ...]] = {
    "lab1": ("torch/amp/grad_scaler.py", "torch/distributed/fsdp/sharded_grad_scaler.py"),
}


_DOTTED = re.compile(r"[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*")  # a name or dotted path, nothing else
_WORD = re.compile(r"[A-Za-z_]\w*")
_SPACED = re.compile(r"\s")  # prose has spaces inside; a name handed to torch has none


def banned(lab: str) -> tuple[str, ...]:
    """The labkit modules (names inside labkit) a submission of `lab` ('lab1'..'lab5', or a check name) may not use."""
    return BANNED.get(lab.split(".")[0], ())


def sandbox_hides(lab: str) -> tuple[str, ...]:
    """What the sandbox of `lab` ('lab1'..'lab5', or a check name) leaves out: its banned labkit modules by name,
    and the torch files a stub stands in for ("torch/..."), as autograder.sandbox.jail.Jail.hide takes them."""
    return banned(lab) + TORCH_HIDDEN.get(lab.split(".")[0], ())


def torch_uses(tree: ast.AST, lab: str) -> list[str]:
    """The torch names of TORCH_BANNED[lab] that the parsed file reaches, by their full name, in order.

    The class counts on a torch path: an import (`from torch.amp import GradScaler`, `import torch.amp.grad_scaler`),
    an attribute chain from torch or from a name imported from it (`a.GradScaler` after `import torch.cuda.amp as
    a`), or bytes holding "torch" and the name (a pickle). A name built at run time, or a string handed to
    pydoc.locate, gets past this reader, not past lab 1's sandbox, whose torch shows a stub in their place
    (TORCH_HIDDEN): the reader is there for the clear message, so it stays away from an honest file's own names and
    its prose. The kernels, which no sandbox can take out of torch, count by their exact names (the trailing
    underscore optional: the out-of-place forms) on a torch path, in a string without spaces (getattr(torch, "..."),
    "aten::...", "torch:..." for pkgutil.resolve_name; a sentence naming them is prose), or in bytes. A method of
    the student's own named after one (self._amp_update_scale) is no torch path.
    """
    names = TORCH_BANNED.get(lab.split(".")[0], {})
    if not names:
        return []
    methods = TORCH_METHODS.get(lab.split(".")[0], ())
    alias: dict[str, str] = {}  # a local name -> the torch path it was imported as
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    found: list[str] = []

    def hit(parts: list[str], rooted: bool, kernels_anywhere: bool = False) -> None:
        for part in parts:
            kernel = part.startswith("_amp_")
            full = names.get(part) or (names.get(part + "_") if kernel else None)  # in place, or out of place
            if full and (rooted or kernels_anywhere and kernel) and full not in found:
                found.append(full)

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            hit(node.module.split(".") + [a.name for a in node.names], node.module.split(".")[0] == "torch")
        elif isinstance(node, ast.Import):
            for a in node.names:
                hit(a.name.split("."), a.name.split(".")[0] == "torch")
        elif isinstance(node, (ast.Attribute, ast.Name)):
            chain = _chain(node)
            if isinstance(node, ast.Attribute) and node.attr in methods and not (
                    chain and chain[0] is not None and alias.get(chain[0], chain[0]).split(".")[0] == "triton"):
                hit([node.attr], True)
            if chain and chain[0] is None:  # off a call or a subscript (import_module("torch"), sys.modules[...]):
                hit(chain[1:], False, True)  # no name of the student's own to mistake, so a kernel counts
            elif chain:
                root = alias.get(chain[0], chain[0]).split(".")
                hit(root + chain[1:], root[0] == "torch")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip() in methods:
            hit([node.value.strip()], True)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and not _SPACED.search(node.value.strip()):
            hit(_WORD.findall(node.value), False, True)  # the kernels alone: a class named in a string is the stub's
        elif isinstance(node, ast.Constant) and isinstance(node.value, bytes):  # data, never prose: a pickle's
            words = _WORD.findall(node.value.decode("latin-1"))  # b"ctorch.amp\nGradScaler\n." names the class
            hit(words, "torch" in words or "ctorch" in words, True)
    return found


def _chain(node: ast.AST) -> list:
    """["torch", "amp", "GradScaler"] for the expression torch.amp.GradScaler; the root None where the attributes
    hang off something else than a name (a call, a subscript); [] for neither."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return [None, *reversed(parts)] if parts else []


def banned_uses(source: str | bytes, lab: str) -> list[str]:
    """The banned modules of `lab` that `source` names ("<name>" for labkit.<name>, then torch classes by their full
    name, "torch.amp.GradScaler"), in order; [] if none or unparsable.

    Give the file's bytes: Python decodes them by the file's own coding declaration, and so does this reader, where
    text decoded as UTF-8 missed a name spelt in UTF-7.

    Catches `import labkit.X`, `from labkit import X`, `from labkit.X import ...`, `labkit.X` as an attribute and
    strings that name it ("labkit.X", "labkit/X.py", or just "X" as in getattr(labkit, "X") in a file that names
    labkit). Obfuscated names
    get past this reader, not past the sandbox, whose labkit has no such module.
    """
    names = banned(lab)
    if not names:
        return []
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, MemoryError, RecursionError):  # it cannot be imported either
        return []
    found = torch_uses(tree, lab)
    # a bare module name in a string ("amp") counts only in a file that names labkit at all
    mentions = any(isinstance(n, ast.Name) and n.id == "labkit" or isinstance(n, ast.Constant)
                   and isinstance(n.value, str) and "labkit" in n.value or isinstance(n, ast.alias)
                   and n.name.split(".")[0] == "labkit" or isinstance(n, ast.ImportFrom)
                   and (n.module or "").split(".")[0] == "labkit" for n in ast.walk(tree))

    def hit(name: str) -> None:
        if name in names and name not in found:
            found.append(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "labkit" and len(parts) > 1:
                    hit(parts[1])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "labkit":
                if len(parts) > 1:
                    hit(parts[1])
                else:
                    for a in node.names:
                        hit(a.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "labkit":
            hit(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            base = node.value.strip().rsplit("/", 1)[-1].strip(". ")
            for n in names:
                if mentions and base in (n, f"{n}.py") or f"labkit.{n}" in node.value or f"labkit/{n}" in node.value:
                    hit(n)
    return found


def message(lab: str, uses: list[str]) -> str:
    """One line for the student: what was used, why it scores nothing, what to do."""
    mods = ", ".join(n if n.startswith("torch.") else f"labkit.{n}" for n in uses)
    allowed_not = [f"labkit.{n}" for n in banned(lab)] + sorted(set(TORCH_BANNED.get(lab, {}).values()))
    return (f"the submission uses {mods}, which implements this lab's answer: write it yourself (not allowed in "
            f"{lab}: {', '.join(allowed_not)}; see the lab's instructions)")
