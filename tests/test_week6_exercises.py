"""Week 6's self-checks catch the usual wrong answers, each with a message that says what differed."""

import contextlib
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit import exercises as ex
from labkit import week6_exercises as w6


def _wrong(eid, answer, *patterns):
    with pytest.raises(ex.Wrong) as err:
        ex.check(eid, answer, quiet=True)
    for p in patterns:
        assert p in str(err.value), f"{eid}: {p!r} not in {err.value}"
    return str(err.value)


# ------------------------------------------------------------------------------------------ 6.1 MFU


def _mfu(factor=3.0, peak_scale=1e12):
    from torch.utils.flop_counter import FlopCounterMode

    def mfu(model, img_per_s, peak_tflops, image_shape=(3, 32, 32)):
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            model.eval()(torch.zeros(1, *image_shape))
        return factor * fc.get_total_flops() * img_per_s / (peak_tflops * peak_scale)

    return mfu


def test_6_1_mfu_catches_the_forward_alone_units_and_the_measured_peak():
    assert "29." in ex.check("6.1", _mfu(), quiet=True)
    _wrong("6.1", _mfu(factor=1.0), "the forward alone")
    _wrong("6.1", _mfu(factor=2.0), "2 forwards")
    _wrong("6.1", _mfu(peak_scale=1.0), "1e12")
    ref = ex.reference("6.1")

    def measured(model, img_per_s, peak_tflops, image_shape=(3, 32, 32)):
        from labkit.bench import load_result

        rec = load_result("ladder")
        if img_per_s == rec["rungs"][-1]["img_per_s"]:
            peak_tflops = rec["peak_bf16_tflops"]  # the measured peak: the old "MFU" column
        return ref(model, img_per_s, peak_tflops, image_shape)

    _wrong("6.1", measured, "measured", "datasheet")


# ----------------------------------------------------------------------------------- 6.2 the step


def _step_maker(autocast=True, channels_last=True, foreach=True, item=False, nesterov=True, detach=True):
    def make_train_step(model, lr, *, momentum=0.9, weight_decay=5e-4, label_smoothing=0.1):
        if channels_last:
            model.to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=nesterov,
                              weight_decay=weight_decay, foreach=foreach)

        def step(x, y):
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with ctx:
                loss = F.cross_entropy(model(x), y, label_smoothing=label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if item:
                print(loss.item())
            return loss.detach() if detach else loss

        return step

    return make_train_step


def test_6_2_step_right_with_foreach_and_each_wrong_answer_named():
    assert "foreach SGD" in ex.check("6.2", _step_maker(), quiet=True)
    _wrong("6.2", _step_maker(autocast=False), "float32", "autocast")
    _wrong("6.2", _step_maker(channels_last=False), "channels_last")
    _wrong("6.2", _step_maker(foreach=False), "fused=True")
    _wrong("6.2", _step_maker(item=True), "host")
    _wrong("6.2", _step_maker(detach=False), "detach")
    _wrong("6.2", _step_maker(nesterov=False), "nesterov")


def test_6_2_a_step_that_forgets_to_zero_the_gradients_is_caught():
    def make_train_step(model, lr, *, momentum=0.9, weight_decay=5e-4, label_smoothing=0.1):
        model.to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=True,
                              weight_decay=weight_decay, fused=True)

        def step(x, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y, label_smoothing=0.1)
            loss.backward()  # gradients pile up from step to step
            opt.step()
            return loss.detach()

        return step

    _wrong("6.2", make_train_step, "zeroes the gradients")


# ------------------------------------------------------------------------------------ 6.3 CUDA graph


def test_6_3_graph_checks_warm_up_static_inputs_and_the_parts_of_a_capture(monkeypatch):
    ref = ex.reference("6.3")
    assert "skipped" in ex.check("6.3", ref, quiet=True) or torch.cuda.is_available()

    def no_warmup(step, static_x, static_y, warmup=3):
        return ref(step, static_x, static_y, warmup=0)

    _wrong("6.3", no_warmup, "warmup=3")

    def stale(step, static_x, static_y, warmup=3):  # never copies the new batch in: every replay the same
        inner = ref(step, static_x, static_y, warmup)
        first = static_x.clone(), static_y.clone()
        return lambda x, y: inner(*first)

    monkeypatch.setattr(w6, "_graph_source_findings", lambda fn: [])  # the run checks alone
    _wrong("6.3", stale, "Copy each new batch")
    monkeypatch.undo()

    def eager_only(step, static_x, static_y, warmup=3):
        for _ in range(warmup):
            step(static_x, static_y)
        return step

    _wrong("6.3", eager_only, "a capture", "replay", "side stream")

    def graphed_callables(step, static_x, static_y, warmup=3):
        torch.cuda.make_graphed_callables  # noqa: B018 - the wrong tool, named
        return eager_only(step, static_x, static_y, warmup)

    assert "make_graphed_callables" in inspect.getsource(graphed_callables)
    _wrong("6.3", graphed_callables, "not the optimizer")


def test_6_3_blank_answer_is_not_done_not_wrong():
    def graph_step(step, static_x, static_y, warmup=3):
        raise NotImplementedError()

    with pytest.raises(ex.NotDone):
        ex.check("6.3", graph_step, quiet=True)


# -------------------------------------------------------------------------------- 6.4 time to accuracy


def test_6_4_time_to_accuracy_edge_cases_and_bad_input():
    ref = ex.reference("6.4")
    assert "8 logs right" in ex.check("6.4", ref, quiet=True)

    def strictly_above(log, target):
        if not 0 < target <= 1:
            raise ValueError("target")
        return ref(log, target + 1e-12)

    _wrong("6.4", strictly_above, "equal to the target")

    def no_start_up(log, target):
        r = ref(log, target)
        return None if r is None else (r[0] - (log["train_start"] - log["process_start"]), r[1])

    _wrong("6.4", no_start_up, "start-up")

    def no_checks(log, target):
        return ref({**log, "train_start": max(log["train_start"], log["process_start"]),
                    "epochs": [{**e, "train_s": abs(e["train_s"])} for e in log["epochs"]]}, min(target, 1.0))

    _wrong("6.4", no_checks, "ValueError")


def test_every_week6_reference_is_not_the_notebooks_worked_answer():
    """The release scan flags copies of a solution region; the references are written apart from them."""
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / "06_resnet_ladder.ipynb").read_text())
    shipped = inspect.getsource(w6)
    for c in nb["cells"]:
        src = "".join(c["source"])
        if c["cell_type"] != "code" or ex.SOLUTION_BEGIN not in src:
            continue
        region = src.split(ex.SOLUTION_BEGIN, 1)[1].split(ex.SOLUTION_END, 1)[0]
        long_lines = {ln.strip() for ln in region.splitlines() if len(ln.strip()) >= 40}
        same = [ln for ln in long_lines if ln in shipped]
        assert len(same) < 3, f"week6_exercises.py repeats a worked answer's lines: {same}"


def test_tiny_model_step_is_capturable_shape():
    step, calls = w6._tiny_step(w6._Tiny())
    loss = step(torch.randn(8, 24), torch.randint(0, 5, (8,)))
    assert calls == [1] and loss.dim() == 0 and not loss.requires_grad
    assert isinstance(w6._Tiny().body[1], nn.BatchNorm1d)


# ------------------------------------------------------------- 6.6-6.9 data parallelism, by hand, on 2 processes

needs_fork = pytest.mark.skipif(not __import__("labkit.dp_scratch").dp_scratch.can_fork(),
                                reason="the 2-process checks fork (Linux)")


@needs_fork
def test_6_6_naive_average_matches_ddp_bit_for_bit_and_a_missing_division_is_named():
    assert "bit-identical" in ex.check("6.6", ex.reference("6.6"), quiet=True)

    def summed(model):
        import torch.distributed as dist

        for p in model.parameters():
            dist.all_reduce(p.grad)  # the sum over the ranks, never divided

    _wrong("6.6", summed, "not the mean", "Divide by the world size")

    def blank(model):
        raise NotImplementedError()

    with pytest.raises(ex.NotDone):
        ex.check("6.6", blank, quiet=True)


@needs_fork
def test_6_7_buckets_right_and_a_skipped_bucket_or_no_bucketing_caught():
    assert "3 buckets" in ex.check("6.7", ex.reference("6.7"), quiet=True)

    def skips_last(params, bucket_bytes):
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        for group in w6.buckets(params, bucket_bytes)[:-1]:  # the last bucket is never sent
            grads = [p.grad for p in group]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            for g, f in zip(grads, _unflatten_dense_tensors(flat / dist.get_world_size(), grads), strict=True):
                g.copy_(f)

    _wrong("6.7", skips_last, "never all-reduced")

    def per_tensor(params, bucket_bytes):
        w6._ref_naive()(nn.ParameterList(params))

    _wrong("6.7", per_tensor, "8 all_reduce calls", "3")


@needs_fork
def test_6_8_overlap_right_and_synchronous_or_late_launches_caught():
    assert "during backward" in ex.check("6.8", ex.reference("6.8"), quiet=True)

    def after_backward(model, bucket_bytes):  # right numbers, nothing overlapped
        params = list(model.parameters())
        return lambda: w6._ref_buckets()(params, bucket_bytes)

    _wrong("6.8", after_backward, "after backward returned")

    def blocking(model, bucket_bytes):
        import torch.distributed as dist

        def hook(p):
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        return lambda: None

    _wrong("6.8", blocking, "async_op=True")
    _wrong("6.8", _overlap(reset=False), "in the first: finish() must reset each bucket's count")
    # never waited on: named from the handles themselves, not from how far the parameters happened to drift
    _wrong("6.8", _overlap(wait=False), "never waited on", "work.wait()")

    # waiting through the handle's future is waiting too
    assert "during backward" in ex.check("6.8", _overlap(wait="future"), quiet=True)
    _wrong("6.8", _overlap(forward=True), "forward order", "reversed")


def _overlap(reset=True, wait=True, forward=False):
    """A hand-written 6.8 with one mistake switched on: counts never reset, no wait() on the handles (wait="future":
    waits through work.get_future() instead), or the buckets in forward order (the same count of buckets, but not the ones backward fills first)."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    def overlap_gradients(model, bucket_bytes):
        params = list(model.parameters())[:: 1 if forward else -1]
        buckets, size = [[]], 0
        for p in params:
            if buckets[-1] and size + p.numel() * p.element_size() > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += p.numel() * p.element_size()
        where = {p: i for i, b in enumerate(buckets) for p in b}
        ready, pending = [0] * len(buckets), []

        def hook(p):
            i = where[p]
            ready[i] += 1
            if ready[i] == len(buckets[i]):
                flat = _flatten_dense_tensors([q.grad for q in buckets[i]])
                pending.append((i, flat, dist.all_reduce(flat, async_op=True)))

        for p in params:
            p.register_post_accumulate_grad_hook(hook)

        def finish():
            for i, flat, work in pending:
                if wait == "future":
                    work.get_future().wait()
                elif wait:
                    work.wait()
                grads = [q.grad for q in buckets[i]]
                for g, new in zip(grads, _unflatten_dense_tensors(flat / dist.get_world_size(), grads), strict=True):
                    g.copy_(new)
            pending.clear()
            if reset:
                ready[:] = [0] * len(buckets)

        return finish

    return overlap_gradients


@needs_fork
def test_6_9_zero1_matches_ddp_measures_the_state_and_catches_a_missing_all_gather():
    verdict = ex.check("6.9", ex.reference("6.9"), quiet=True)
    assert "unsharded" in verdict and "reduce_scatter" in verdict and "all_gather" in verdict

    def unsharded(params, make_optimizer):  # right numbers, the whole state on every rank
        params = list(params)
        opt = make_optimizer(params)

        def step():
            w6._ref_naive()(nn.ParameterList(params))
            opt.step()

        return step, opt

    _wrong("6.9", unsharded, "nothing is sharded")

    def looked_up_once(params, make_optimizer):  # the collectives fetched at set-up, as the prose's getattr allows
        import torch.distributed as dist

        names = ("reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single", "all_gather_into_tensor")
        found = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
        step, opt = w6._ref_zero1()(params, make_optimizer)

        def stepped():  # the reference looks them up at each call: hand it the set-up's functions
            saved = {n: getattr(dist, n) for n in found}
            for n, f in found.items():
                setattr(dist, n, f)
            try:
                step()
            finally:
                for n, f in saved.items():
                    setattr(dist, n, f)

        return stepped, opt

    verdict = ex.check("6.9", looked_up_once, quiet=True)
    assert "collectives all_gather, reduce_scatter" in verdict, verdict

    def no_gather(params, make_optimizer):
        import torch.distributed as dist

        params = list(params)
        step, opt = w6._ref_zero1()(params, make_optimizer)
        real = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor

        def without():
            saved = {n: getattr(dist, n) for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)}
            for n in saved:  # the updated shards never travel: each rank keeps its stale copy of the others'
                setattr(dist, n, lambda out, inp, **kw: out[: inp.numel()].copy_(inp) if dist.get_rank() == 0
                        else out[-inp.numel():].copy_(inp))
            try:
                step()
            finally:
                for n, f in saved.items():
                    setattr(dist, n, f)
            assert real

        return without, opt

    _wrong("6.9", no_gather, "drifted apart")

    def summed(params, make_optimizer):
        import torch.distributed as dist

        params = list(params)
        step, opt = w6._ref_zero1()(params, make_optimizer)

        def doubled():  # the reference divides by the world size: undo it, as if the division were forgotten
            for p in params:
                p.grad.mul_(dist.get_world_size())
            step()

        return doubled, opt

    _wrong("6.9", summed, "divided by the world size")


    def all_reduced(params, make_optimizer):  # the right numbers from an all_reduce of the whole flat gradient
        import torch.distributed as dist

        params = list(params)
        world, rank = dist.get_world_size(), dist.get_rank()
        total = sum(p.numel() for p in params)
        per = -(-total // world)
        flat = torch.zeros(per * world)
        torch.cat([p.detach().reshape(-1) for p in params], out=flat[:total])
        mine = flat[rank * per:(rank + 1) * per].clone().requires_grad_(True)
        opt = make_optimizer([mine])

        def step():
            g = torch.zeros(per * world)
            torch.cat([p.grad.reshape(-1) for p in params], out=g[:total])
            dist.all_reduce(g)
            mine.grad = g[rank * per:(rank + 1) * per] / world
            opt.step()
            w6._collective("all_gather_into_tensor")(flat, mine.detach())
            with torch.no_grad():
                at = 0
                for p in params:
                    p.copy_(flat[at:at + p.numel()].view_as(p))
                    at += p.numel()

        return step, opt

    _wrong("6.9", all_reduced, "collectives were all_gather, all_reduce", "reduce_scatter_single")

    def swapped(params, make_optimizer):  # reduce_scatter_single(input, output): gloo refuses the sizes
        import torch.distributed as dist

        step, opt = w6._ref_zero1()(params, make_optimizer)
        real = w6._collective("reduce_scatter_tensor")

        def stepped():
            name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
            setattr(dist, name, lambda out, inp, **kw: real(inp, out, **kw))
            try:
                step()
            finally:
                setattr(dist, name, real)

        return stepped, opt

    message = _wrong("6.9", swapped, "take the output first", "your code raised RuntimeError: Check failed")
    assert "out of step" not in message and "\n" not in message, message  # gloo's log prefix and newline dropped


@needs_fork
def test_ranks_whose_collectives_go_out_of_step_are_named(monkeypatch):
    monkeypatch.setattr(w6, "DP_TIMEOUT_S", 6.0)  # gloo gives up 3 s before the check would

    def only_rank_one(model):
        import torch.distributed as dist

        if dist.get_rank() == 1:  # rank 0 never makes this call
            dist.all_reduce(next(model.parameters()).grad)

    _wrong("6.6", only_rank_one, "out of step")


@needs_fork
def test_a_rank_that_hangs_is_killed_and_named_within_the_timeout():
    import time

    from labkit import dp_scratch as D

    t = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] gave no answer"):
        D.run_ranks(lambda rank, world: rank == 0 or time.sleep(60), timeout_s=2.0)
    assert time.monotonic() - t < 10


def test_without_fork_the_data_parallel_checks_say_what_they_skip(monkeypatch):
    from labkit import dp_scratch as D

    monkeypatch.setattr(D, "can_fork", lambda: False)
    for eid in ("6.6", "6.7", "6.8", "6.9"):
        verdict = ex.check(eid, ex.reference(eid), quiet=True)
        assert "skipped" in verdict and "2 forked processes" in verdict and eid in verdict
    with pytest.raises(RuntimeError, match="cannot fork"):
        D.run_ranks(lambda rank, world: rank)


@needs_fork
def test_a_child_forked_after_cuda_started_sees_no_accelerator_and_the_parent_keeps_its_own(monkeypatch):
    from labkit import dp_scratch as D

    before = torch.cuda.is_available
    monkeypatch.setattr(torch._C, "_cuda_isInBadFork", lambda: True, raising=False)  # what a child of a CUDA parent reads

    def seen(rank, world):
        opt = torch.optim.Adam([torch.zeros(3, requires_grad=True)])
        opt.param_groups[0]["params"][0].grad = torch.ones(3)
        opt.step()  # asks the accelerator about graph capture: must not reach a CUDA context inherited by fork
        acc = torch.accelerator.current_accelerator(check_available=True) if hasattr(torch, "accelerator") else None
        return [torch.cuda.is_available(), acc]

    assert D.run_ranks(seen) == [[False, None], [False, None]]
    assert torch.cuda.is_available is before


def _markdown(title_part: str) -> str:
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / "06_resnet_ladder.ipynb").read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
    hits = [c for c in cells if title_part in c]
    assert len(hits) == 1, title_part
    return hits[0]


def test_the_notebook_says_what_the_data_parallel_checks_ask_for():
    """What 6.8's and 6.9's checks refuse is said in their prose; the objectives name section 8's exercises."""
    assert "(6.6–6.9)" in _markdown("What you should be able to do after this notebook")
    overlap = _markdown("### Exercise 6.8")
    assert "every handle waited on" in overlap and "get_future()" in overlap
    zero = _markdown("### Exercise 6.9")
    assert "a reduce-scatter and an all-gather, no all_reduce" in zero


def test_the_timing_and_state_cells_say_what_is_missing_instead_of_raising(capsys, monkeypatch):
    """6.8's comparison needs 6.7's timing too, and 6.9's reading its state: a student who skipped 6.7 (or whose
    check failed) reads which one is missing, not a KeyError."""
    import json
    from pathlib import Path

    from labkit import dp_scratch, predict

    nb = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / "06_resnet_ladder.ipynb").read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    timing = next(c for c in cells if 'w6.LAST_TIMING[k]) for k in ("6.7", "6.8")' in c)
    state = next(c for c in cells if 'w6.LAST_STATE.get("6.9")' in c)
    monkeypatch.setattr(w6, "LAST_TIMING", {"6.8": [(2.0, 1.0)] * 3})
    monkeypatch.setattr(w6, "LAST_STATE", {})
    env = {"w6": w6, "dp_scratch": dp_scratch, "predict": predict, "prediction_overlap_helps": None,
           "prediction_state_fraction": None}
    exec(timing, env)
    exec(state, env)
    out = capsys.readouterr().out
    assert "not timed yet: 6.7" in out and "not measured yet" in out, out


@needs_fork
def test_6_9_runs_an_odd_count_of_parameters_so_a_missing_padding_is_caught():
    """At world size 2 an even count needs no padding, and a ZeRO-1 without it would pass: the check's MLP has
    an odd one, and gloo's refusal of the unpadded sizes comes back with what the sizes must be."""
    from labkit import dp_scratch as D

    assert sum(p.numel() for p in D.mlp(w6._recipe(adam=True).sizes).parameters()) % D.WORLD == 1
    assert "odd number of\nparameters, so at two ranks the padding is one zero" in _markdown("### Exercise 6.9")

    def unpadded(params, make_optimizer):
        import torch.distributed as dist

        params = list(params)
        world, rank = dist.get_world_size(), dist.get_rank()
        per = sum(p.numel() for p in params) // world
        mine = torch.cat([p.detach().reshape(-1) for p in params])[rank * per:(rank + 1) * per].clone()
        opt = make_optimizer([mine.requires_grad_(True)])

        def step():
            out = torch.empty(per)
            w6._collective("reduce_scatter_tensor")(out, torch.cat([p.grad.reshape(-1) for p in params]))
            mine.grad = out / world
            opt.step()

        return step, opt

    _wrong("6.9", unpadded, "padded with zeros to a multiple of the world size")
