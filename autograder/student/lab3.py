"""Lab 3 probes: run the student's fixed training loop (and the slow script, as the baseline) on given seeds.

The scenario `train_run(train, device, params)` takes the training function as an argument: the trusted side
runs it with the `train` of the student's variant of slow_train.py (rendered there; the baseline's process
receives its source) and the probes run it with the student's `train`, so both see the same data (lab3_slow),
model initialization and batch order. A probe only reports observations (losses, correct predictions, optimizer
steps, samples seen, host-sync sites); the answer key, the seeds used when grading and every verdict stay with
the trusted side.

params of a run: n (images), data_seed (make_data), init_seed (torch.manual_seed before Net()), seed (the
batch order, as train's `seed`), steps, batch_size.
"""

from __future__ import annotations

import numbers

import torch

from autograder.student import lab3_slow as slow
from autograder.student.probes import call, host_sync_sites, require, synchronize

LR, MOMENTUM = 0.05, 0.9  # the optimizer the slow script's __main__ uses; the student's train gets it built
# The public timing (the notebook's Try-it cell and the release's speed check): one run of each loop per round, on
# the notebook's seeds and data (made before the clock starts), `SPEED_STEPS` steps each.
SPEED_ROUNDS, SPEED_STEPS = 9, 20
PUBLIC_RUN = {"n": 1024, "batch_size": 64, "data_seed": 0, "init_seed": 0, "seed": 0}
TIMING = (f"both loops in one process, on one CPU thread (on a GPU, by CUDA events), interleaved A-B-B-A after a "
          f"warm-up round, {SPEED_ROUNDS} rounds of {SPEED_STEPS} steps each on the notebook's seeds; the median of "
          f"the per-round ratios, with their interquartile range (IQR)")


def data(params: dict):
    """The run's (uint8 images (n, 32, 32, 3), int64 labels (n,)), as make_data makes them."""
    return slow.make_data(n=int(params["n"]), seed=int(params["data_seed"]))


def fresh_model(device, params: dict):
    """A freshly initialized Net and its SGD optimizer, with counters of optimizer steps and samples seen."""
    torch.manual_seed(int(params["init_seed"]))
    model = slow.Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    counts = {"steps": 0, "samples": 0}
    opt.register_step_post_hook(lambda *a: counts.__setitem__("steps", counts["steps"] + 1))
    model.register_forward_pre_hook(lambda m, a: counts.__setitem__("samples", counts["samples"] + a[0].shape[0]))
    return model, opt, counts


def invoke(train, model, opt, images, labels, device, params: dict):
    """One call of `train` with the slow script's signature; returns what it returned."""
    return train(model, opt, images, labels, steps=int(params["steps"]), batch_size=int(params["batch_size"]),
                 seed=int(params["seed"]), device=device)


def observe(out, counts: dict) -> dict:
    """What a run returned, as the trusted side reads it: losses (float64 tensor), correct (int), counters."""
    require(isinstance(out, dict) and "losses" in out and "correct" in out,
            'train() must return {"losses": [...], "correct": ...} like slow_train.train')
    losses = out["losses"]
    if isinstance(losses, torch.Tensor):
        losses = losses.detach().to("cpu", torch.float64).reshape(-1)
    else:
        require(isinstance(losses, (list, tuple)), "losses must be a list of floats or a tensor, got "
                f"{type(losses).__name__}")
        losses = torch.tensor([_number(v, "each loss", float) for v in losses], dtype=torch.float64)
    correct = _number(out["correct"], "correct", int)
    return {"losses": losses, "correct": correct, "steps": counts["steps"], "samples": counts["samples"]}


def _number(v, what: str, kind):
    """`kind` (float or int) of a plain number or a one-element tensor; a clear failure for anything else."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.detach().reshape(()).item()
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
    require(ok and (kind is float or float(v).is_integer()),
            f"{what} must be a {'number' if kind is float else 'count'}, got {str(v)[:60]!r}")
    return kind(v)


def train_run(train, device, params: dict, images=None, labels=None) -> dict:
    """Train a fresh Net with `train` for params["steps"] steps; what came out (see `observe`)."""
    if images is None:
        images, labels = data(params)
    model, opt, counts = fresh_model(device, params)
    return observe(invoke(train, model, opt, images, labels, device, params), counts)


def _student_train(p):
    fn = p.attr("train")
    return lambda *a, **k: call("train(...)", fn, *a, **k)


def student_train(p):
    """The student's `train`, each call made through the probe (a failure in it is reported as the student's)."""
    return _student_train(p)


def probe_answers(p, params: dict) -> dict:
    """What bottlenecks() declares: its type, and its items as (site, kind) strings, in order."""
    ans = call("bottlenecks()", p.attr("bottlenecks"))
    if not isinstance(ans, dict):
        return {"type": type(ans).__name__, "pairs": []}
    return {"type": "dict", "pairs": [[str(k), str(v)] for k, v in list(ans.items())[:64]], "size": len(ans)}


def probe_train(p, params: dict) -> dict:
    """One run of the student's train on the given seeds."""
    return train_run(_student_train(p), p.device, params)


def probe_host_syncs(p, params: dict) -> dict:
    """Sync sites of one run of the student's train (after a short warm-up run), and what that run returned.

    The model is built and moved to the device before counting: copying parameters is not the loop's doing.
    """
    train = _student_train(p)
    images, labels = data(params)
    train_run(train, p.device, {**params, "steps": int(params["warmup_steps"])}, images, labels)
    model, opt, counts = fresh_model(p.device, params)
    box = {}
    sites = host_sync_sites(lambda: box.setdefault("out", invoke(train, model, opt, images, labels, p.device,
                                                                 params)), p.device)
    return {"sites": sites, **observe(box.get("out"), counts)}


def probe_prepare(p, params: dict) -> dict:
    """Make the data of the timed runs ahead (untimed): one data set per seed in params["data_seeds"]; in the
    baseline's process also load the slow script's variant from params["slow_source"]."""
    if "slow_source" in params:
        p.state["lab3_slow"] = slow.load(str(params["slow_source"]))
    store = p.state.setdefault("lab3_data", {})
    for s in params["data_seeds"]:
        store[str(s)] = data({"n": params["n"], "data_seed": s})
    return {"prepared": len(store)}


def _timed(p, train, params: dict) -> dict:
    if isinstance(params.get("images"), torch.Tensor):  # made by the grader, sent inside the timed request
        images, labels = _sent_data(params)
    else:
        prepared = p.state.get("lab3_data", {}).pop(str(params["data_seed"]), None)
        images, labels = prepared if prepared is not None else data(params)
    out = train_run(train, p.device, params, images, labels)
    synchronize(p.device)
    return out


def _sent_data(params: dict):
    images, labels = params["images"], params["labels"]
    n = int(params["n"])
    require(isinstance(labels, torch.Tensor) and images.dtype == torch.uint8 and tuple(images.shape) == (n, 32, 32, 3)
            and labels.dtype == torch.int64 and tuple(labels.shape) == (n,), "the timed run's data is malformed")
    return images, labels


def probe_timed_train(p, params: dict) -> dict:
    """A timed run of the student's train on the data sent with the request (made by the grader, outside the
    timing); the trusted side checks its result."""
    return _timed(p, _student_train(p), params)


def probe_slow_train(p, params: dict) -> dict:
    """The baseline's timed run: the variant's slow train on data made ahead (a process without student code)."""
    mod = p.state.get("lab3_slow")
    require(mod is not None, "lab3.prepare did not send the slow script's source")
    return _timed(p, mod.train, params)


def compare_speed(slow_train, fixed_train, device="cpu", *, rounds: int = SPEED_ROUNDS, steps: int = SPEED_STEPS):
    """The public timing of lab 3 (`TIMING`): `fixed_train` against `slow_train` on the same fresh model and data.

    Both are functions with the slow script's signature. Returns a labkit.bench.ABResult: ratio = slow seconds /
    fixed seconds per run (above 1: the fixed loop is faster), ratio_iqr, and each side's seconds per run.
    On a CPU both run on one thread, the count restored after: on a loaded 2-core machine a second thread waits
    for a busy core, and the same run can take several times as long from one round to the next.
    """
    from labkit import bench  # the trusted side's and the notebook's; the grader's probes never time here

    if rounds < 3 or steps < 1:
        raise ValueError(f"compare_speed needs rounds >= 3 (for an IQR) and steps >= 1, got {rounds}, {steps}")
    dev = torch.device(device)
    params = {**PUBLIC_RUN, "steps": int(steps)}
    images, labels = data(params)  # made once, before the clock: the two loops time their own work only
    with bench.torch_threads(1 if dev.type == "cpu" else None):
        return bench.compare(lambda: train_run(slow_train, dev, params, images, labels),
                             lambda: train_run(fixed_train, dev, params, images, labels),
                             device=dev, rounds=rounds, warmup=1)


def describe_speed(ab) -> str:
    """One line for a `compare_speed` result, the same in the notebook and in the public check."""
    per_step = 1e3 / SPEED_STEPS
    return (f"{ab.ratio:.2f}x the slow script (IQR {ab.ratio_iqr:.2f}; {ab.b.median * per_step:.1f} against "
            f"{ab.a.median * per_step:.1f} ms per step)")
