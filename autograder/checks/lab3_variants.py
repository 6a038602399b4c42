"""Lab 3's slow_train.py, one variant per student: which bottlenecks are planted, and at which marked sites.

Every variant trains the same model on the same data in the same order and computes the same losses and
accuracy (to float rounding); what differs is how it is slow. A variant is a `Spec`: one form for each slot of
the script (a data pipeline, an overhead, and per-step sync or compute habits, each slow or harmless) and the
harmless lines that carry a site mark as decoys. Nine lines are marked, lettered [A]..[I] from the top, so the
letters of the planted sites move with the decoys: one student's answer is wrong for another's.

Four bottlenecks are planted in every variant: one in the data pipeline, the overhead of anomaly detection, and
two per-step habits, so every variant costs about the same to profile and fix, and a complete fix clears the
same speed tiers (measured on a CPU; the GPU tiers are not yet measured per variant).

The spec comes from the course secret and the student id (`spec_for`). The open-kit default has one variant for
everyone, `CLASSIC`: the repository's own slow_train.py. This module is instructor-only: it knows every form's
kind, i.e. the answers. Students get only a rendered file (`python -m autograder variant lab3 --student ID`).

Each handed-out file carries a variant tag on its first line, HMAC(course secret, "lab3.variant-tag", student id):
only the secret's holder can make a student's tag, so a hand-in holding a classmate's file, the common one or
another course's is told apart from a wrong answer (`tag_verdict`), and the grader says so to a person.
"""

from __future__ import annotations

import inspect
import random
import re
import types
from dataclasses import dataclass, field
from pathlib import Path

from autograder.base import course_secret

LETTERS = "ABCDEFGHI"
KINDS = ("data", "overhead", "sync", "compute")
PLANTED = 4  # bottlenecks per variant

# slot -> form -> the kinds an answer may give for it (None: the form is harmless). The slots' order is the
# order of their lines in the script.
FORMS: dict[str, dict[str, tuple[str, ...] | None]] = {
    "data": {"per_sample": ("data",), "numpy": ("data",)},
    "overhead": {"anomaly": ("overhead", "sync")},
    "hooks": {"none": None, "stats": ("overhead", "compute")},
    "guard": {"none": None, "isfinite": ("sync",)},
    "extra_forward": {"none": None, "eval_forward": ("compute",)},
    "grad_norm": {"none": None, "item": ("sync", "overhead")},
    "record": {"detach": None, "item": ("sync",), "tolist": ("sync",)},
    "count": {"tensor": None, "per_sample": ("sync", "overhead"), "item": ("sync",)},
}
# Two of these per-step habits are planted in each variant. The data pipeline and the overhead are always planted:
# on a CPU they are most of what a fix gains (anomaly detection alone ~1.3x), so every variant's complete fix
# clears the same CPU tiers; the habits cost little on a CPU and much on a GPU (host syncs, launches).
HABITS = ("hooks", "guard", "extra_forward", "grad_norm", "record", "count")
# Harmless lines that may carry a mark (a decoy); "record" and "count" only in their harmless forms.
DECOYS = ("gen", "perm", "batch_loop", "slice", "mode", "state", "epoch", "to_device", "loss", "zero_grad", "backward",
          "opt_step", "record", "count")


@dataclass(frozen=True)
class Spec:
    """One variant of slow_train.py: a form per slot and the decoy lines that carry a site mark."""

    forms: dict = field(hash=False)  # slot -> form name (FORMS)
    decoys: tuple[str, ...]  # DECOYS entries marked as sites (9 - PLANTED of them)

    def planted(self) -> list[str]:
        """The slots whose form is a bottleneck."""
        return [s for s in FORMS if FORMS[s][self.forms[s]] is not None]


CLASSIC = Spec({"data": "per_sample", "overhead": "anomaly", "hooks": "none", "guard": "none", "extra_forward": "none",
                "grad_norm": "none", "record": "item", "count": "per_sample"},
               ("perm", "mode", "epoch", "to_device", "loss"))


def spec_for(student: str | None, secret: course_secret.Secret | None = None) -> Spec:
    """The variant of `student` (None: the course's common variant) under the course secret.

    The open-kit default gives CLASSIC to everyone; a course secret draws a variant from HMAC(secret, student),
    never CLASSIC itself (whose answers are in the open kit's solution).
    """
    secret = secret or course_secret.load()
    if secret.open_kit:
        return CLASSIC
    rnd = random.Random(course_secret.derive("lab3.variant", student, secret))
    while True:
        habits = set(rnd.sample(HABITS, PLANTED - 2))
        forms = {"data": rnd.choice(sorted(FORMS["data"])), "overhead": "anomaly"}
        for slot in HABITS:
            slow = sorted(f for f, k in FORMS[slot].items() if k is not None)
            fast = next(f for f, k in FORMS[slot].items() if k is None)
            forms[slot] = rnd.choice(slow) if slot in habits else fast
        pool = [d for d in DECOYS if d not in ("record", "count") or FORMS[d][forms[d]] is None]
        spec = Spec(forms, tuple(sorted(rnd.sample(pool, len(LETTERS) - PLANTED), key=DECOYS.index)))
        if _render_lines(spec) != _render_lines(CLASSIC):
            return spec


# ------------------------------------------------------------------------------------------------ rendering

HEADER = '''"""slow_train.py: trains a small CNN on synthetic images. It is correct, and much slower than it needs to be.

Lab 3 asks you to find what makes it slow. The comments [A] to [I] mark the candidate sites; some are real
bottlenecks, the others are harmless. (The grader regenerates this file to time it as the baseline.)
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

MEAN = torch.tensor([0.4914, 0.4822, 0.4465])
STD = torch.tensor([0.2470, 0.2435, 0.2616])


'''

MAIN = '''

if __name__ == "__main__":
    torch.manual_seed(0)
    images, labels = make_data()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    result = train(model, opt, images, labels, steps=60)
    print(f"final loss {result['losses'][-1]:.3f}, training accuracy {result['correct'] / (60 * 64):.1%}")
'''

# A line is (indent, text, site): site names the slot or decoy whose mark the line may carry.
_DATA = {
    "per_sample": [(8, "xs = []", None),
                   (8, "for i in idx.tolist():", "data"),
                   (12, "img = images[i].permute(2, 0, 1).float() / 255", None),
                   (12, "xs.append((img - MEAN[:, None, None]) / STD[:, None, None])", None),
                   (8, "yield torch.stack(xs), labels[idx]", None)],
    "numpy": [(8, "xs = []", None),
              (8, "for i in idx.tolist():", "data"),
              (12, 'img = torch.from_numpy(images[i].numpy().transpose(2, 0, 1).astype("float32")) / 255', None),
              (12, "xs.append((img - MEAN[:, None, None]) / STD[:, None, None])", None),
              (8, "yield torch.stack(xs), labels[idx]", None)],
}
_SETUP = {"anomaly": ([(4, "torch.autograd.set_detect_anomaly(True)", "overhead")],
                      [(8, "torch.autograd.set_detect_anomaly(False)", None)])}
_HOOKS = ([(4, "stats = []  # activation sizes, for a dashboard", None),
           (4, "hooks = [m.register_forward_hook(lambda _m, _i, o: stats.append(o.detach().abs().mean()))", "hooks"),
           (4, "         for m in model.modules()]", None)],
          [(8, "for h in hooks:", None), (12, "h.remove()", None)])
_RECORD = {"detach": (16, "losses.append(loss.detach())", "record"),
           "item": (16, "losses.append(loss.item())", "record"),
           "tolist": (16, "losses.append(loss.tolist())", "record")}


def _count(form: str, pred: str) -> list:
    if form == "per_sample":
        return [(16, f"for p, t in zip({pred}, y, strict=True):", "count"), (20, "correct += int(p == t)", None)]
    if form == "item":
        return [(16, f"correct += ({pred} == y).sum().item()", "count")]
    return [(16, f"correct += ({pred} == y).sum()", "count")]


def _train_lines(spec: Spec) -> list:
    f = spec.forms
    setup, teardown = _SETUP[f["overhead"]]
    if f["hooks"] != "none":
        setup, teardown = setup + _HOOKS[0], teardown + _HOOKS[1]
    pred = "pred" if f["extra_forward"] != "none" else "out.argmax(1)"
    body = [(16, "x, y = x.to(device), y.to(device)", "to_device"),
            (16, "out = model(x)", None),
            (16, "loss = F.cross_entropy(out, y)", "loss")]
    if f["guard"] != "none":
        body += [(16, "if not torch.isfinite(loss):", "guard"),
                 (20, 'raise FloatingPointError(f"loss is {loss} at step {step}")', None)]
    if f["extra_forward"] != "none":
        body += [(16, "with torch.no_grad():  # accuracy of the weights that made this loss", None),
                 (20, "pred = model(x).argmax(1)", "extra_forward")]
    body += [(16, "optimizer.zero_grad()", "zero_grad"), (16, "loss.backward()", "backward")]
    if f["grad_norm"] != "none":
        body += [(16, "grad_norms.append(sum(p.grad.norm() ** 2 for p in model.parameters()).item() ** 0.5)",
                  "grad_norm")]
    body += [(16, "optimizer.step()", "opt_step"), _RECORD[f["record"]], *_count(f["count"], pred)]
    state = "losses, correct, step, epoch = [], 0, 0, 0"
    if f["grad_norm"] != "none":
        state = "losses, correct, step, epoch, grad_norms = [], 0, 0, 0, []"
    losses = "losses" if f["record"] != "detach" else "torch.stack(losses).tolist() if losses else []"
    return [(0, "def train(model, optimizer, images, labels, *, steps: int, batch_size: int = 64, seed: int = 0, "
                'device="cpu"):', None),
            (4, '"""Train for `steps` steps; returns {"losses": one float per step, "correct": right training '
                'predictions}."""', None),
            *setup,
            (4, "model.train()", "mode"),
            (4, state, "state"),
            (4, "try:", None),
            (8, "while step < steps:", None),
            (12, "for x, y in batches(images, labels, batch_size, seed + epoch):", "epoch"),
            *body,
            (16, "step += 1", None), (16, "if step == steps:", None), (20, "break", None),
            (12, "epoch += 1", None),
            (4, "finally:", None),
            *teardown,
            (4, f'return {{"losses": {losses}, "correct": int(correct)}}' if f["count"] == "tensor"
             else f'return {{"losses": {losses}, "correct": correct}}', None)]


def _render_lines(spec: Spec) -> list:
    batches = [(0, "def batches(images, labels, batch_size: int, seed: int):", None),
               (4, '"""One epoch of (normalized float images NCHW, labels) in a seeded random order; drops the last '
                   'partial batch."""', None),
               (4, "g = torch.Generator().manual_seed(seed)", "gen"),
               (4, "order = torch.randperm(len(labels), generator=g)", "perm"),
               (4, "for s in range(0, len(order) - batch_size + 1, batch_size):", "batch_loop"),
               (8, "idx = order[s:s + batch_size]", "slice"),
               *_DATA[spec.forms["data"]]]
    return [*batches, (0, "", None), (0, "", None), *_train_lines(spec)]


def _marked(spec: Spec) -> set[str]:
    return set(spec.planted()) | set(spec.decoys)


def render(spec: Spec) -> str:
    """The variant's slow_train.py, its nine sites marked [A]..[I] from the top."""
    from autograder.student import lab3_slow

    marked, letters, out = _marked(spec), iter(LETTERS), []
    for indent, text, site in _render_lines(spec):
        line = " " * indent + text if text else ""
        if site in marked:
            line += f"  # [{next(letters)}]"
            marked.discard(site)  # a slot's first line carries its mark
        out.append(line)
    shared = "\n\n".join(inspect.getsource(obj) for obj in (lab3_slow.make_data, lab3_slow.Net))
    return HEADER + shared + "\n\n" + "\n".join(out) + "\n" + MAIN


def answer_key(spec: Spec) -> dict[str, tuple[str, ...]]:
    """{site letter: kinds accepted} for the planted sites of the variant."""
    sites = [s for _, _, s in _render_lines(spec) if s is not None]
    order = []
    for s in sites:
        if s in _marked(spec) and s not in order:
            order.append(s)
    assert len(order) == len(LETTERS), order
    return {LETTERS[i]: FORMS[s][spec.forms[s]] for i, s in enumerate(order) if s in FORMS
            and FORMS[s][spec.forms[s]] is not None}


# A marked line every loop has, that a GPU profile honestly shows as a cost, with the kinds it honestly has: the
# per-batch copy `x.to(device)` is a blocking copy, after which PyTorch synchronizes the stream. Naming it is
# neither credit (it is never planted) nor a false alarm, so an honest student who profiled on a GPU loses nothing.
NEUTRAL = {"to_device": ("sync", "data")}


def neutral_sites(spec: Spec) -> dict[str, tuple[str, ...]]:
    """{site letter: kinds} of the variant's marked lines that score nothing either way (NEUTRAL); a neutral
    line named with another kind is a false alarm."""
    letters, out = iter(LETTERS), {}
    for s in [s for s in dict.fromkeys(x for _, _, x in _render_lines(spec) if x is not None) if s in _marked(spec)]:
        letter = next(letters)
        if s in NEUTRAL:
            out[letter] = NEUTRAL[s]
    return out


def load(spec: Spec) -> types.ModuleType:
    """The variant as a module (its `train` is the baseline and the reference the student's run is held to)."""
    from autograder.student import lab3_slow

    return lab3_slow.load(render(spec))


def reference_fix(reference_source: str, spec: Spec) -> str:
    """A reference solution for the variant: the lab's reference module with the variant's answers."""
    key = {site: kinds[0] for site, kinds in answer_key(spec).items()}
    return reference_source + f"\n\ndef bottlenecks() -> dict:  # this variant's answers\n    return {key!r}\n"


TAG_LABEL = "lab3.variant-tag"
TAG_LINE = "# labkit variant tag: {tag} (the grader checks it against your student id: keep this line)"
_TAG = re.compile(r"^# labkit variant tag: ([0-9a-f]{32})\b")


def variant_tag(student: str | None, secret: course_secret.Secret | None = None) -> str:
    """The tag of `student`'s handout (None: the course's common variant): 32 hex digits of
    HMAC-SHA256(secret, "lab3.variant-tag" NUL student); nobody without the secret can make one."""
    return course_secret.derive(TAG_LABEL, student, secret).hex()[:32]


def handout(student: str | None, secret: course_secret.Secret | None = None) -> str:
    """The slow_train.py handed to `student` (None: the common variant): the variant, its tag on the first line."""
    secret = secret or course_secret.load()
    return TAG_LINE.format(tag=variant_tag(student, secret)) + "\n" + render(spec_for(student, secret))


def read_tag(source: str) -> str | None:
    """The variant tag on the first line of a slow_train.py, or None."""
    m = _TAG.match(source.lstrip("\ufeff")[:200])
    return m.group(1) if m else None


def tag_verdict(tag: str | None, student: str, secret: course_secret.Secret,
                classmates: list[str] | tuple[str, ...] = ()) -> tuple[str, str] | None:
    """None when `tag` is `student`'s own; else (what it is, for the student; whose, for the instructor).

    `classmates`: the class's ids, so a classmate's tag is named to the instructor."""
    import hmac

    if tag is None or hmac.compare_digest(tag, variant_tag(student, secret)):
        return None
    if hmac.compare_digest(tag, variant_tag(None, secret)):
        return "the course's common variant, not yours", "the common variant"
    owner = next((c for c in classmates if c != student and hmac.compare_digest(tag, variant_tag(c, secret))), None)
    if owner:
        return "another student's variant", f"{owner}'s variant"
    return ("a variant this course never handed out (another course's, or an edited tag)",
            "no variant of this course under its secret")


def roster_ids(path: str | Path) -> list[str]:
    """The student ids of a class list (a CSV with a student_id column), in order, each once."""
    import csv

    from labkit.errors import LabkitError

    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            ids = [r["student_id"].strip() for r in csv.DictReader(f) if (r.get("student_id") or "").strip()]
    except (OSError, KeyError, csv.Error, UnicodeDecodeError) as e:
        raise LabkitError(f"cannot read the roster {path} (a CSV with a student_id column): {e}") from None
    if not ids:
        raise LabkitError(f"the roster {path} names no student (a CSV with a student_id column)")
    return list(dict.fromkeys(ids))


def write(out_dir: str | Path, students: list[str | None], secret: course_secret.Secret | None = None, *,
          per_student: bool = False) -> list[Path]:
    """Write slow_train.py for each student (`handout`: tagged): OUT/slow_train.py for one, OUT/<id>/slow_train.py
    for several, or for every one with `per_student` (a class list of one still gets its <id> folder)."""
    from labkit.errors import LabkitError

    secret = secret or course_secret.load()
    out = Path(out_dir)
    bad = [s for s in students if s is not None and (not s or Path(s).name != s or s.startswith("."))]
    if bad:
        raise LabkitError(f"student ids must be plain folder names, got {bad[:3]}")
    written = []
    for s in students:
        dest = out / "slow_train.py" if len(students) == 1 and not per_student else out / str(s) / "slow_train.py"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(handout(s, secret))
        written.append(dest)
    return written
