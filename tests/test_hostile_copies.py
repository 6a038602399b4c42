"""Copies of known answers: a renamed copy of code that ships to students (labkit's scalers, torch's GradScaler)
scored full marks, since the reader bans names and imports, not code. The similarity report names each such copy
and its source; honest work is not named."""

import inspect
import json
import re
import sys
from pathlib import Path

from autograder.gradebook import similarity

sys.path.insert(0, str(Path(__file__).parent / "data"))
import similarity_class  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAB = "lab1_loss_scaling"


def _renamed(src: str) -> str:
    """The copy a student would make: every identifier they could choose renamed, comments dropped."""
    names = {n for n in re.findall(r"\b(?:def|class)\s+(\w+)", src)} | set(re.findall(r"\b(\w+)\s*=", src))
    names -= {"self", "cls"}
    for i, n in enumerate(sorted(names, key=len, reverse=True)):
        src = re.sub(rf"\b{re.escape(n)}\b", f"v{i}_x", src)
    return re.sub(r"#[^\n]*", "", src)


def _lab1_reference() -> str:
    nb = json.loads((ROOT / "assignments" / "source" / LAB / f"{LAB}.ipynb").read_text())
    for c in nb["cells"]:
        text = "".join(c["source"])
        if text.startswith("%%writefile"):
            return re.sub(r"^\s*### (BEGIN|END) SOLUTION\s*$", "", text.split("\n", 1)[1], flags=re.M)
    raise AssertionError("lab 1 has no %%writefile cell")


def test_the_known_sources_of_lab1_are_labkits_scalers_and_torchs_grad_scaler():
    known = similarity.known_sources(LAB)
    assert {"labkit/loss_scaling.py", "torch/amp/grad_scaler.py"} <= set(known)
    assert all(len(v) > 1000 for v in known.values())
    assert similarity.known_sources("lab3_profile_fix") == {}  # lab 3 bans nothing that ships


def test_renamed_copies_of_labkit_and_torch_are_named_with_their_source():
    from torch.amp import grad_scaler

    from labkit import loss_scaling

    known = similarity.known_sources(LAB)
    starter = similarity.starter_code(ROOT / "assignments", LAB)
    files = {"copier_labkit": _renamed(inspect.getsource(loss_scaling.DynamicLossScaler)),
             "copier_torch": "import torch\n" + _renamed(inspect.getsource(grad_scaler.GradScaler.unscale_))
             + _renamed(inspect.getsource(grad_scaler.GradScaler.update)),
             "honest_ref": _lab1_reference(), **similarity_class.SOLUTIONS}
    copies = {c.student: c for c in similarity.against_known(files, known, starter)}
    assert set(copies) == {"copier_labkit", "copier_torch"}, {k: (c.source, c.share) for k, c in copies.items()}
    assert copies["copier_labkit"].source == "labkit/loss_scaling.py" and copies["copier_labkit"].share > 0.6
    assert copies["copier_torch"].source == "torch/amp/grad_scaler.py"
    text = similarity.report_text(LAB, [], {"compared": 0, "pairs": 0, "median": 0, "spread": 0,
                                            "common_fingerprints_excluded": 0, "too_small": []},
                                  [], files, copies=list(copies.values()))
    assert "COPIES OF KNOWN ANSWERS: 2" in text and "copier_labkit" in text and "labkit/loss_scaling.py" in text


def test_a_whole_class_copying_the_same_module_is_still_named():
    """The class comparison drops what most of the class shares; the known-source check must not."""
    from labkit import loss_scaling

    copy = _renamed(inspect.getsource(loss_scaling.DynamicLossScaler))
    files = {f"s{i}": copy for i in range(6)}
    copies = similarity.against_known(files, similarity.known_sources(LAB))
    assert len(copies) == 6
