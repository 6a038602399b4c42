"""Week 5's exercises (profiling): the checks behind the notebook's self-check cells, and labkit's references.

- 5.1 a torch.profiler schedule around a loop: wait / warmup / active / repeat, on_trace_ready, prof.step()
- 5.2 reading the key-averages table: the top operator by self CPU time, the `data` range's share of the step
- 5.3 phase labels: record_function ranges (torch.profiler) and NVTX ranges (Nsight Systems) around a step
- 5.4 reading `nsys stats`: the dominant kernel and the data range's share, from cuda_gpu_kern_sum and nvtx_sum
- 5.5 a bottleneck verdict from a few measured numbers, held to labkit.diagnosis on clear cases
- 5.6 the data scenario fixed: the step's wait for data falls, same model and batch

Every check runs on a CPU in seconds; where a part needs a GPU (NVTX ranges seen by nsys, CUDA activity),
it checks what a CPU can and its verdict says what it left out.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from labkit import diagnosis as D
from labkit import exercises as ex
from labkit import profiling as P
from labkit.bench import result_path

PHASE_NAMES = ("data", "forward", "backward", "optimizer")
NSYS_DIR = result_path("week5_nsys", topic="notebooks")  # benchmarks/week5_nsys.py writes here


# ------------------------------------------------------------------------------------------ 5.1 schedule


def _reference_profile_loop():
    from torch.profiler import ProfilerActivity, profile, schedule

    def profile_loop(step, out_dir, wait=1, warmup=1, active=3, repeat=1):
        """labkit's version: one Chrome trace per active cycle, written by on_trace_ready."""
        kinds = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            kinds.append(ProfilerActivity.CUDA)
        os.makedirs(out_dir, exist_ok=True)

        def write(p):
            p.export_chrome_trace(os.path.join(out_dir, f"cycle_{p.step_num}.pt.trace.json"))

        cycle = dict(wait=wait, warmup=warmup, active=active, repeat=repeat)
        with profile(activities=kinds, schedule=schedule(**cycle), on_trace_ready=write) as p:
            for _ in range((wait + warmup + active) * repeat):
                step()
                p.step()
        return p

    return profile_loop


def _read_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def recorded_steps(out_dir: str | os.PathLike) -> list[list[int]]:
    """The ProfilerStep numbers each Chrome trace file under `out_dir` holds, one sorted list per file."""
    files = sorted(glob.glob(os.path.join(out_dir, "**", "*.json*"), recursive=True))
    cycles = []
    for f in files:
        names = {str(e.get("name", "")) for e in _read_trace(f).get("traceEvents", []) if isinstance(e, dict)}
        cycles.append(sorted(int(n.split("#")[1]) for n in names if n.startswith("ProfilerStep#")))
    return sorted(cycles)


def _expected_steps(wait: int, warmup: int, active: int, repeat: int) -> list[list[int]]:
    cycle = wait + warmup + active
    return [[k * cycle + wait + warmup + i for i in range(active)] for k in range(repeat)]


@ex.exercise("5.1", "a profiler schedule around a loop", reference=_reference_profile_loop)
def check_profile_loop(profile_loop) -> str:
    from torch.profiler import ProfilerActivity, record_function

    P.quiet_cpu_profiler()
    said = []
    for wait, warmup, active, repeat in ((1, 1, 2, 2), (0, 1, 1, 3)):
        calls = [0]

        def step(calls=calls):
            calls[0] += 1
            with record_function("work"):
                torch.randn(32, 32) @ torch.randn(32, 32)

        with tempfile.TemporaryDirectory() as d, _quiet_cycle_warning():
            prof = profile_loop(step, d, wait=wait, warmup=warmup, active=active, repeat=repeat)
            want_calls = (wait + warmup + active) * repeat
            sched = f"wait={wait}, warmup={warmup}, active={active}, repeat={repeat}"
            assert calls[0] == want_calls, (f"with {sched} the loop should run step() {want_calls} times "
                                            f"((wait + warmup + active) x repeat), it ran {calls[0]}")
            assert hasattr(prof, "key_averages") and hasattr(prof, "step_num"), (
                f"return the torch.profiler.profile object (the `as prof` of the with block), "
                f"not {type(prof).__name__}")
            got, want = recorded_steps(d), _expected_steps(wait, warmup, active, repeat)
            assert len(got) == repeat, (f"with {sched}, on_trace_ready should write one trace file per active "
                                        f"cycle into out_dir: want {repeat}, found {len(got)} (use "
                                        f"torch.profiler.tensorboard_trace_handler(out_dir), or export_chrome_trace "
                                        f"to a new file name each time)")
            assert got == want, (f"with {sched} the traces should hold ProfilerStep#{want}, they hold {got}: call "
                                 f"prof.step() once at the end of every iteration, after step()")
            work = [r.count for r in prof.key_averages() if r.key == "work"]
            assert work == [active], (f"the key-averages table of the last cycle should count the step's 'work' "
                                      f"range {active} times, it counts {work or 0}")
            if torch.cuda.is_available():
                assert ProfilerActivity.CUDA in prof.activities, (
                    "this machine has a CUDA GPU: ask for ProfilerActivity.CUDA too, or the trace has no kernels")
        said.append(f"{sched}: steps {want}")
    gpu = ("CUDA activity asked for" if torch.cuda.is_available()
           else "no GPU here, so CUDA activity was not checked")
    return "; ".join(said) + f", one trace per cycle; {gpu}"


@contextlib.contextmanager
def _quiet_cycle_warning():
    import warnings

    with warnings.catch_warnings():  # repeat > 1 warns once that each cycle clears the last one's events
        warnings.filterwarnings("ignore", message=".*[Pp]rofiler clears events.*")
        yield


# ---------------------------------------------------------------------------------- 5.2 the table


def _reference_read_table():
    def read_table(prof):
        """labkit's version: (top aten operator by self CPU time, the 'data' range's share of the step)."""
        r = P.read_key_averages(prof, phase="data", by="cpu")
        return r["top_op"], r["phase_share"]

    return read_table


def _labelled_loop(heavy: str, data_ms: float):
    """A finished profile of 4 steps (1 warm-up, 3 recorded) of a loop with `data` and `forward` ranges."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    P.quiet_cpu_profiler()
    x = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=3, repeat=1)) as prof:
        for _ in range(4):
            with record_function("data"):
                time.sleep(data_ms / 1e3)
                batch = x + 1
            with record_function("forward"):
                for _ in range(4):
                    batch = (batch @ x).tanh() if heavy == "matmul" else batch.sort(dim=1).values.neg()
            prof.step()
    return prof


@ex.exercise("5.2", "reading the key-averages table", reference=_reference_read_table)
def check_read_table(read_table) -> str:
    said = []
    for heavy, data_ms in (("matmul", 4.0), ("sort", 1.0)):
        prof = _labelled_loop(heavy, data_ms)
        want = P.read_key_averages(prof, phase="data", by="cpu")
        got = read_table(prof)
        assert isinstance(got, tuple) and len(got) == 2, f"return a pair (top operator name, data share), got {got!r}"
        op, share = got
        assert op == want["top_op"], (f"the top operator by self CPU time is {want['top_op']!r}, you said {op!r}: "
                                      f"rank the aten:: rows of prof.key_averages() by self_cpu_time_total (time "
                                      f"in the operator itself, not in what it calls)")
        assert isinstance(share, float | int) and abs(share - want["phase_share"]) <= 0.01, (
            f"the 'data' range took {want['phase_share']:.3f} of the step, you said {share!r}: divide the 'data' "
            f"row's cpu_time_total by the 'ProfilerStep*' row's")
        said.append(f"{want['top_op']} on top, data {100 * want['phase_share']:.0f}% of the step")
    return "; ".join(said)


# -------------------------------------------------------------------------------------- 5.3 labels


def _reference_annotated_step():
    from torch.profiler import record_function

    @contextlib.contextmanager
    def labelled(name, nvtx):
        with record_function(name), (torch.cuda.nvtx.range(name) if nvtx else contextlib.nullcontext()):
            yield

    def annotated_step(model, opt, next_batch, nvtx=False):
        """labkit's version: each phase inside record_function(name), and torch.cuda.nvtx.range(name) if nvtx."""
        with labelled("data", nvtx):
            x, y = next_batch()
        with labelled("forward", nvtx):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        with labelled("backward", nvtx):
            loss.backward()
        with labelled("optimizer", nvtx):
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    return annotated_step


class _NvtxRecorder:
    """Stands in for torch's NVTX binding while a check runs: records pushes and pops, needs no CUDA."""

    def __init__(self):
        self.calls: list[tuple[str, str | None]] = []

    def rangePushA(self, msg):  # noqa: N802 - the binding's own names
        self.calls.append(("push", msg))
        return len([c for c in self.calls if c[0] == "push"]) - len([c for c in self.calls if c[0] == "pop"]) - 1

    def rangePop(self):  # noqa: N802
        self.calls.append(("pop", None))
        return 0

    def markA(self, msg):  # noqa: N802
        self.calls.append(("mark", msg))

    def rangeStartA(self, msg):  # noqa: N802
        self.calls.append(("start", msg))
        return len(self.calls)

    def rangeEnd(self, handle):  # noqa: N802
        self.calls.append(("end", None))


@contextlib.contextmanager
def _recorded_nvtx():
    import torch.cuda.nvtx as nvtx

    rec, saved = _NvtxRecorder(), nvtx._nvtx
    nvtx._nvtx = rec
    try:
        yield rec
    finally:
        nvtx._nvtx = saved


def _tiny_training():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)

    def next_batch():
        return torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)

    return model, opt, next_batch


def _phase_events(trace: dict) -> dict[str, list[dict]]:
    X = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    return {ph: [e for e in X if e.get("name") == ph and e.get("cat") in ("user_annotation", "cpu_op")]
            for ph in PHASE_NAMES}, X


def _inside(outer: dict, events: list[dict], prefix: str) -> bool:
    a, b = outer["ts"], outer["ts"] + outer["dur"]
    return any(str(e.get("name", "")).startswith(prefix) and a <= e["ts"] <= b for e in events)


@ex.exercise("5.3", "phase labels for torch.profiler and NVTX", reference=_reference_annotated_step)
def check_annotated_step(annotated_step) -> str:
    from torch.profiler import ProfilerActivity, profile

    P.quiet_cpu_profiler()
    model, opt, next_batch = _tiny_training()
    before = [p.detach().clone() for p in model.parameters()]
    with _recorded_nvtx() as rec, profile(activities=[ProfilerActivity.CPU]) as prof:
        loss = annotated_step(model, opt, next_batch, nvtx=True)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0, f"return the step's loss (a 0-d tensor), got {loss!r}"
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)), (
        "the parameters did not change: the step must run backward and opt.step()")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.json")
        prof.export_chrome_trace(path)
        phases, X = _phase_events(_read_trace(path))
    for ph in PHASE_NAMES:
        assert len(phases[ph]) == 1, (f"one step should hold one record_function({ph!r}) range, the trace has "
                                      f"{len(phases[ph])}: wrap that phase in `with torch.profiler.record_function"
                                      f"({ph!r}):`")
    order = sorted(PHASE_NAMES, key=lambda ph: phases[ph][0]["ts"])
    assert order == list(PHASE_NAMES), f"the ranges should come in the order {list(PHASE_NAMES)}, they came {order}"
    for ph, prefix, what in (("forward", "aten::linear", "the model's Linear layers"),
                             ("backward", "autograd::engine::evaluate_function", "autograd's backward functions"),
                             ("optimizer", "Optimizer.step#", "the optimizer's step")):
        assert _inside(phases[ph][0], X, prefix), f"the {ph!r} range should hold {what} ({prefix}...); it does not"
    pushes = [m for k, m in rec.calls if k in ("push", "start")]
    pops = [k for k, _ in rec.calls if k in ("pop", "end")]
    assert pushes == list(PHASE_NAMES), (f"with nvtx=True the step should push the NVTX ranges {list(PHASE_NAMES)}, "
                                         f"in order (torch.cuda.nvtx.range(name)); it pushed {pushes}")
    assert len(pops) == len(pushes), f"{len(pushes)} NVTX ranges pushed but {len(pops)} popped: close every range"
    with _recorded_nvtx() as rec:
        annotated_step(model, opt, next_batch, nvtx=False)
    assert not rec.calls, ("with nvtx=False the step should push no NVTX range (on a CPU-only build of torch NVTX "
                           f"raises); it made {len(rec.calls)} NVTX calls")
    return ("data, forward, backward and optimizer ranges in order, each around its work, and the same four NVTX "
            "ranges (recorded here by a stand-in; nsys reads them on a GPU)")


# ------------------------------------------------------------------------------------------ 5.4 nsys

# A made-up sample of `nsys stats` output, for checking parsers only: the numbers measure nothing.
SAMPLE_KERN_SUM = """\
Processing [sample.sqlite] with [/opt/nvidia/nsight-systems/reports/cuda_gpu_kern_sum.py]...

 ** CUDA GPU Kernel Summary (cuda_gpu_kern_sum):

 Time (%)  Total Time (ns)  Instances  Avg (ns)   Med (ns)   Min (ns)  Max (ns)   StdDev (ns)  Name
 --------  ---------------  ---------  ---------  ---------  --------  ---------  -----------  ----------------------------------------------
     46.0       92,000,000        400  230,000.0  229,000.0   220,000    260,000      8,000.0  sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64
     31.0       62,000,000      1,200   51,666.7   50,000.0    40,000     90,000      9,000.0  void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1>(cudnnTensorStruct, const float *)
     15.0       30,000,000      2,000   15,000.0   15,000.0    10,000     20,000      2,000.0  void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char *, 3>>(int, T2, T3)
      8.0       16,000,000        100  160,000.0  160,000.0   150,000    170,000      5,000.0  void at::native::(anonymous namespace)::multi_tensor_apply_kernel  (SGD)
"""
SAMPLE_NVTX_SUM = """\
 ** NVTX Range Summary (nvtx_sum):

 Time (%)  Total Time (ns)  Instances  Avg (ns)      Med (ns)      Min (ns)    Max (ns)    StdDev (ns)  Style    Range
 --------  ---------------  ---------  ------------  ------------  ----------  ----------  -----------  -------  ---------
     50.0      250,000,000         20  12,500,000.0  12,400,000.0  12,000,000  14,000,000    300,000.0  PushPop  :step
     27.0      135,000,000         20   6,750,000.0   6,700,000.0   6,000,000   8,000,000    400,000.0  PushPop  :data
     12.0       60,000,000         20   3,000,000.0   3,000,000.0   2,900,000   3,200,000     50,000.0  PushPop  :backward
      7.0       35,000,000         20   1,750,000.0   1,750,000.0   1,700,000   1,800,000     20,000.0  PushPop  :forward
      4.0       20,000,000         20   1,000,000.0   1,000,000.0     900,000   1,100,000     30,000.0  PushPop  :optimizer
"""
SAMPLE_KERN_CSV = """\
"Time (%)","Total Time (ns)","Instances","Avg (ns)","Med (ns)","Min (ns)","Max (ns)","StdDev (ns)","Name"
"12.0","6000000","300","20000.0","20000.0","19000","21000","500.0","void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, T2, T3)"
"88.0","44000000","100","440000.0","440000.0","430000","450000","3000.0","ampere_sgemm_128x64_nn"
"""
SAMPLE_NVTX_CSV = """\
"Time (%)","Total Time (ns)","Instances","Avg (ns)","Med (ns)","Min (ns)","Max (ns)","StdDev (ns)","Style","Range"
"60.0","90000000","10","9000000.0","9000000.0","8800000","9200000","100000.0","PushPop","step"
"6.0","9000000","10","900000.0","900000.0","880000","920000","10000.0","PushPop","data"
"""
SAMPLES = {"column text": (SAMPLE_KERN_SUM, SAMPLE_NVTX_SUM), "CSV": (SAMPLE_KERN_CSV, SAMPLE_NVTX_CSV)}


def recorded_nsys_stats(folder: str | os.PathLike = NSYS_DIR) -> tuple[str, str] | None:
    """(cuda_gpu_kern_sum text, nvtx_sum text) of the recorded nsys run in `folder`, or None where none is."""
    folder = Path(folder)
    kern, nvtx = folder / "cuda_gpu_kern_sum.txt", folder / "nvtx_sum.txt"
    if not (kern.is_file() and nvtx.is_file()):
        return None
    return kern.read_text(), nvtx.read_text()


def nsys_record(folder: str | os.PathLike = NSYS_DIR) -> dict | None:
    """The JSON record benchmarks/week5_nsys.py wrote beside the summaries (card, torch, commit, command,
    status), flattened with its environment; None where there is none."""
    path = Path(folder) / "week5_nsys.json"
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    return {**rec.get("env", {}), **rec}


def _reference_read_nsys():
    def read_nsys(kernel_summary, nvtx_summary):
        """labkit's version: (dominant kernel, its share of kernel time, the data range's share of the step)."""
        r = P.read_nsys_stats(kernel_summary, nvtx_summary)
        return r["top_kernel"], r["top_kernel_share"], r["data_share"]

    return read_nsys


@ex.exercise("5.4", "reading nsys stats", reference=_reference_read_nsys)
def check_read_nsys(read_nsys) -> str:
    cases = dict(SAMPLES)
    shipped = recorded_nsys_stats()
    if shipped is not None:
        cases["the recorded GPU run"] = shipped
    for label, (kern, nvtx) in cases.items():
        want = P.read_nsys_stats(kern, nvtx)
        got = read_nsys(kern, nvtx)
        assert isinstance(got, tuple) and len(got) == 3, (
            f"return (kernel name, its share of kernel time, data share), got {got!r}")
        name, share, data = got
        assert name == want["top_kernel"], (f"{label}: the kernel with the most total time is "
                                            f"{want['top_kernel'][:80]!r}, you said {str(name)[:80]!r} (keep the "
                                            f"whole name, spaces included: it is the last column)")
        assert abs(share - want["top_kernel_share"]) <= 1e-3, (
            f"{label}: that kernel took {want['top_kernel_share']:.4f} of all kernel time, you said {share!r} "
            f"(a fraction: Total Time over the sum of Total Time)")
        assert abs(data - want["data_share"]) <= 1e-3, (
            f"{label}: the data range's total time over the step range's is {want['data_share']:.4f}, you said "
            f"{data!r} (nsys may print range names with a leading ':')")
    made = nsys_record()
    why = (f"the recorded run made no summaries (status: {made.get('status')})" if made is not None
           else f"no recorded nsys run in {NSYS_DIR.parent.name}/{NSYS_DIR.name}")
    skipped = "" if shipped is not None else f"; {why}, so only the samples were read"
    return f"read {', '.join(cases)}{skipped}"


# ------------------------------------------------------------------------------------- 5.5 diagnosis

VERDICT_KEYS = ("device", "data_share", "gpu_busy_share", "syncs_per_step", "kernels_per_step", "mean_kernel_us",
                "small_op_share")
CLEAR_MARGIN = 2.5  # a case is clear when labkit's top cause has at least this times the next one's share


def measured(source) -> dict:
    """The few numbers exercise 5.5 decides from, out of a Diagnosis, its evidence or a trace_stats dict:
    device, data_share (share of the step waiting for the next batch), gpu_busy_share (share the GPU runs
    kernels or copies; None on a CPU), syncs_per_step (host syncs), kernels_per_step, mean_kernel_us and
    small_op_share (share of the non-data time outside operators of 20 us or more)."""
    ev = source.evidence if isinstance(source, D.Diagnosis) else source
    if not isinstance(ev, dict) or "data_share" not in ev:
        raise ex.LabkitError(f"measured needs a Diagnosis or its evidence, not {type(source).__name__}")
    return {k: ev.get(k) for k in VERDICT_KEYS}


def _reference_verdict():
    def verdict(m):
        """labkit's version: the largest of the cause shares that these numbers can tell apart."""
        if m["data_share"] >= 0.5:
            return "data"
        if m["device"] != "cuda":
            return "overhead" if m["small_op_share"] >= 0.5 else "compute"
        if m["gpu_busy_share"] >= 1 - D.GPU_IDLE_LIMIT:
            return "compute"
        # a host that syncs every few kernels never lets the GPU queue fill; fewer syncs leave it to launches
        syncing = m["syncs_per_step"] >= 1 and m["kernels_per_step"] <= 10 * m["syncs_per_step"]
        return "sync" if syncing else "overhead"

    return verdict


def clear_cases(live_cpu: bool = True) -> list[dict]:
    """The cases where one cause stands out (CLEAR_MARGIN times the next), each {name, kind, verdict, device,
    numbers (`measured`)}: the recorded GPU traces of plain PyTorch loops (trace_corpus), the course's scenarios
    as benchmarks/week5_profiling.py recorded them on a GPU (their shares ranked as `diagnose` ranks them now)
    and, with `live_cpu`, three scenarios profiled here on the CPU."""
    from labkit import scenarios as S

    found = [(f"{p.name.split('.')[0]} (recorded GPU trace)", D.diagnose(p))
             for p in sorted(result_path("trace_corpus", topic="diagnosis").glob("*.pt.trace.json.gz"))]
    if live_cpu:
        for name, fixed in (("overhead", False), ("compute", False), ("overhead", True)):
            cfg = S.with_changes(S.scenario_config(name, fixed=fixed, quick=True), n_samples=1024)
            found.append((f"{cfg.name} (profiled here on the CPU)",
                          P.profile_steps(S.Workload(cfg, "cpu"), "cpu").diagnose()))
    out = [{"name": n, "kind": d.kind, "verdict": d.verdict, "device": d.device, "numbers": measured(d),
            "shares": [c["share"] for c in d.causes]} for n, d in found]
    out += _recorded_scenarios()
    return [c for c in out if _clear(c["shares"])]


def _recorded_scenarios() -> list[dict]:
    """The scenarios of week5_profiling.json (a GPU run), decided from their recorded shares: busy time is
    compute, idle time goes to its cause; a scenario's data range ranks by its share (in-thread loading)."""
    path = result_path("week5_profiling.json")
    if not path.is_file():
        return []
    rec = json.loads(path.read_text())
    if rec.get("device_type") != "cuda":
        return []
    out = []
    for name, e in rec.get("scenarios", {}).items():
        for v in ("slow", "fixed"):
            ev = e.get(v, {}).get("evidence")
            if not ev or ev.get("gpu_busy_share") is None:
                continue
            shares = {"compute": ev["gpu_busy_share"], **ev["idle_by_cause"]}
            kind = max(shares, key=shares.get)
            out.append({"name": f"{name}-{v} (recorded on {rec['env'].get('device_name', 'a GPU')})", "kind": kind,
                        "verdict": f"{D.CAUSES[kind]} {100 * shares[kind]:.0f}% of the step", "device": "cuda",
                        "numbers": measured(ev), "shares": sorted(shares.values(), reverse=True)})
    return out


def _clear(shares: list[float]) -> bool:
    shares = sorted(shares, reverse=True)
    return len(shares) < 2 or shares[0] >= CLEAR_MARGIN * shares[1]


@ex.exercise("5.5", "a bottleneck verdict from the numbers", reference=_reference_verdict)
def check_verdict(verdict) -> str:
    cases = clear_cases()
    assert cases, "no clear cases found (the recorded traces under benchmarks/results/diagnosis/trace_corpus are missing)"
    wrong = []
    for c in cases:
        got = verdict(dict(c["numbers"]))
        if got not in D.KINDS:
            raise ex.Wrong(f"Exercise 5.5: return one of {list(D.KINDS)}, not {got!r} (case {c['name']})")
        if got != c["kind"]:
            nums = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in c["numbers"].items())
            wrong.append(f"{c['name']}: labkit says {c['kind']!r} ({c['verdict']}), you said {got!r}; "
                         f"the numbers: {nums}")
    assert not wrong, (f"{len(wrong)} of {len(cases)} clear cases differ:\n  " + "\n  ".join(wrong[:4])
                       + "\nhint: look at data first, then (on a GPU) how busy it is, then how often the host syncs "
                         "for the kernels it launches")
    kinds = sorted({c["kind"] for c in cases})
    gpu = any(c["device"] == "cuda" for c in cases)
    left = "" if gpu else (f"; the recorded GPU traces ({result_path('trace_corpus', topic='diagnosis')}) are not here, so no GPU case "
                           f"was checked")
    return f"agrees with labkit.diagnosis on all {len(cases)} clear cases ({', '.join(kinds)}){left}"


# ---------------------------------------------------------------------------- 5.6 the data scenario


def _reference_fix_data():
    from labkit import scenarios as S

    def fix_data(cfg):
        """labkit's version: the scenario's own fix, one switch."""
        return S.with_changes(cfg, **S.SCENARIOS["data"].fixed)

    return fix_data


SAME_STEP = ("batch", "width", "depth", "precision", "optimizer", "host_reads", "n_samples")


@ex.exercise("5.6", "fix the data scenario", reference=_reference_fix_data)
def check_fix_data(fix_data) -> str:
    from labkit import scenarios as S

    slow = S.with_changes(S.scenario_config("data", quick=True), n_samples=1024)  # 1024 images: a faster build
    mine = fix_data(slow)
    assert isinstance(mine, S.WorkloadConfig), f"return a WorkloadConfig (S.with_changes(cfg, ...)), not {mine!r}"
    changed = [f for f in SAME_STEP if getattr(mine, f) != getattr(slow, f)]
    assert not changed, (f"keep the model and the batch as they are ({', '.join(changed)} changed): fix how the "
                         f"batches are made, not what the step computes")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sched = P.ProfileSchedule(wait=1, warmup=1, active=4)
    got = {}
    for label, cfg in (("slow", slow), ("yours", S.with_changes(mine, name="data-yours"))):
        d = P.profile_steps(S.Workload(cfg, dev), dev, schedule=sched).diagnose()
        got[label] = (d.evidence["data_share"] * d.evidence["step_ms"], d)
    (slow_ms, _), (mine_ms, d) = got["slow"], got["yours"]
    assert mine_ms <= 0.5 * slow_ms, (f"the step still waits {mine_ms:.2f} ms for its batch against {slow_ms:.2f} "
                                      f"ms before (want half or less): change what makes the batches slow "
                                      f"(see S.WorkloadConfig's loader)")
    return (f"on {dev} the wait for data fell from {slow_ms:.2f} to {mine_ms:.2f} ms per step; labkit's verdict "
            f"now: {d.verdict}")
