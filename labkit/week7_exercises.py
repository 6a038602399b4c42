"""Week 7's exercises (Triton kernels): the checks behind the notebook's self-check cells, and labkit's kernels.

7.1 fuses the top rung's data path into one kernel: a uint8 batch (B, C, H, W) in, a random crop of the
zero-padded image (offsets given per image), a horizontal flip (a flag per image) and the per-channel
normalization, float32 out. Checked against the PyTorch composition (`torch_augment_normalize`, the gather of
`labkit.data.augment_batch` followed by `labkit.data.normalize`) on odd sizes, within TOL.
7.2 is BatchNorm's apply step (per-channel scale and shift, as BatchNorm folds its statistics and affine weights
into in eval mode or once they are known) fused with ReLU and an optional residual add, the way a ResNet block
ends: y = relu(x * scale[c] + shift[c] (+ residual)). Checked against `torch_bn_relu`.
7.3 is its backward as a `torch.autograd.Function`: the gradient of x and of the residual, and the per-channel
sums that are the gradients of scale and shift; checked against autograd on `torch_bn_relu`.
7.4 counts the bytes each kernel moves (every tensor it touches read or written once, in its dtype), the number a
roofline needs; checked against `bytes_moved` below.

Triton is imported by `load_triton`, never at import time: on a machine without CUDA it first sets
TRITON_INTERPRET=1, so the kernels run in Triton's interpreter (NumPy on the CPU: right answers, meaningless
times). Where Triton is not importable at all (macOS, Windows) it says so, and the notebook skips the checks.
Every check counts the Triton launches the student's code makes: an answer that computes the result with
PyTorch ops alone is told that no kernel ran.
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import exercises as ex
from labkit.env import LabkitError
from labkit.kernels_bench import count_launches  # noqa: F401  (the checks below, and W7.count_launches in tests)

TOL = 1e-5  # absolute and relative: a kernel may round x/255 and (x - mean)/std differently from PyTorch's ops
GRAD_TOL = 1e-4  # the per-channel sums add the same terms in another order
tl = None  # triton.language once load_triton() ran: the kernels below read it when they are compiled


class TritonMissing(LabkitError):
    """Triton cannot be imported here (it ships for Linux only): the kernels of week 7 cannot run."""


# ------------------------------------------------------------------------------------------------ triton


def load_triton():
    """(triton, triton.language), in the interpreter when there is no CUDA device; TritonMissing if not importable.

    TRITON_INTERPRET is read when a kernel is decorated and launched, so setting it here works even after
    torch imported triton."""
    global tl
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton
        import triton.language as language
    except ImportError as e:
        raise TritonMissing(f"triton is not importable here ({e}); it ships for Linux only, so on macOS or Windows "
                            "the kernels of this week cannot run: read them, and run them on Colab or a Linux "
                            "machine") from None
    tl = language
    if interpreted():
        _interpretable_language()
    return triton, language


def _interpretable_language() -> None:
    """Make triton.language's own helpers callable from interpreted kernels.

    tl.sum, tl.max, tl.zeros and the others are themselves @triton.jit functions, decorated once, when
    triton.language is first imported. If that happened before TRITON_INTERPRET was set (torch.compile imports
    triton), they are compiled-mode functions, which an interpreted kernel cannot call: wrap each again as the
    interpreter would have, in every module of triton.language that holds it."""
    import sys

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict[int, InterpretedFunction] = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction):
                setattr(mod, attr, wrapped.setdefault(id(obj), InterpretedFunction(obj.fn)))


def interpreted() -> bool:
    """True when Triton kernels run in the interpreter (TRITON_INTERPRET=1): right answers, no meaningful times."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


class _Stub:
    """Stands in for triton / triton.language where Triton is missing, so that the notebook's kernel cells still
    define their functions (`@triton.jit` leaves them as they are); anything else says why it cannot run."""

    constexpr = object

    def __init__(self, why: str):
        self._why = why

    @staticmethod
    def jit(fn=None, **_):
        return fn if fn is not None else (lambda f: f)

    def __getattr__(self, name):
        raise TritonMissing(self._why)


def triton_or_stub():
    """(triton, triton.language, None) where Triton imports, else (stub, stub, why): the notebook's import cell."""
    try:
        triton, language = load_triton()
    except TritonMissing as e:
        return _Stub(str(e)), _Stub(str(e)), str(e)
    return triton, language, None


def _no_kernel(launches: list[int], what: str) -> None:
    if not launches[0]:
        raise AssertionError(f"no Triton kernel ran: {what} must launch your @triton.jit kernel "
                             "(kernel[grid](...)); a PyTorch composition is what the check compares against")


# ------------------------------------------------------------------------------- the PyTorch compositions


def torch_augment_normalize(x: torch.Tensor, oy: torch.Tensor, ox: torch.Tensor, flip: torch.Tensor,
                            mean: torch.Tensor, std: torch.Tensor, pad: int = 4) -> torch.Tensor:
    """The top rung's data path in PyTorch: crop (B, C, H, W) uint8 from the zero-padded image at row oy[b] and
    column ox[b] (0 ... 2 * pad), mirror image b when flip[b], then (x / 255 - mean[c]) / std[c] in float32.

    The same gather as `labkit.data.augment_batch` (with its offsets given instead of drawn), then
    `labkit.data.normalize` with the given statistics."""
    b, c, h, w = x.shape
    dev = x.device
    xp = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    ar_h, ar_w = torch.arange(h, device=dev), torch.arange(w, device=dev)
    cols = ox.long()[:, None] + torch.where(flip.bool()[:, None], ar_w.flip(0)[None], ar_w[None])
    rows = oy.long()[:, None] + ar_h[None]
    bi = torch.arange(b, device=dev)[:, None, None, None]
    ci = torch.arange(c, device=dev)[None, :, None, None]
    crop = xp[bi, ci, rows[:, None, :, None], cols[:, None, None, :]]
    return (crop.float() / 255 - mean.float().view(1, c, 1, 1)) / std.float().view(1, c, 1, 1)


def torch_bn_relu(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """relu(x * scale[c] + shift[c] (+ residual)) on an NCHW tensor, in x's dtype: BatchNorm applied, the block's
    residual added, then ReLU (the order of a ResNet basic block's end)."""
    c = x.shape[1]
    z = x * scale.to(x.dtype).view(1, c, 1, 1) + shift.to(x.dtype).view(1, c, 1, 1)
    return torch.relu(z if residual is None else z + residual)


# --------------------------------------------------------------------------------- labkit's own kernels
# Written once for every card: a flat 1-D grid over the output, BLOCK elements per program.


def _augment_kernel(x_ptr, oy_ptr, ox_ptr, flip_ptr, mean_ptr, std_ptr, out_ptr, total, C, H, W, PAD,
                    BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = idx < total
    col = idx % W
    row = (idx // W) % H
    chan = (idx // (W * H)) % C
    img = idx // (W * H * C)
    mirrored = tl.load(flip_ptr + img, mask=live, other=0) != 0
    src_col = tl.where(mirrored, W - 1 - col, col) + tl.load(ox_ptr + img, mask=live, other=0) - PAD
    src_row = row + tl.load(oy_ptr + img, mask=live, other=0) - PAD
    inside = live & (src_row >= 0) & (src_row < H) & (src_col >= 0) & (src_col < W)
    pix = tl.load(x_ptr + ((img * C + chan) * H + src_row) * W + src_col, mask=inside, other=0)
    mu = tl.load(mean_ptr + chan, mask=live, other=0.0)
    sigma = tl.load(std_ptr + chan, mask=live, other=1.0)
    tl.store(out_ptr + idx, (pix.to(tl.float32) / 255.0 - mu) / sigma, mask=live)


def _bn_relu_kernel(x_ptr, scale_ptr, shift_ptr, res_ptr, y_ptr, total, C, HW, HAS_RES: tl.constexpr,
                    BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = idx < total
    chan = (idx // HW) % C
    val = tl.load(x_ptr + idx, mask=live, other=0.0).to(tl.float32)
    val = val * tl.load(scale_ptr + chan, mask=live, other=0.0) + tl.load(shift_ptr + chan, mask=live, other=0.0)
    if HAS_RES:
        val += tl.load(res_ptr + idx, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + idx, tl.maximum(val, 0.0).to(y_ptr.dtype.element_ty), mask=live)


def _bn_relu_bwd_kernel(g_ptr, x_ptr, scale_ptr, shift_ptr, res_ptr, gx_ptr, gres_ptr, dscale_ptr, dshift_ptr,
                        N, C, HW, HAS_RES: tl.constexpr, IMGS: tl.constexpr, BLOCK: tl.constexpr):
    # One program per (channel, group of IMGS images): its two partial sums land in row `group` of the
    # (groups, C) partial buffers, which the launcher adds up (no atomics: the same sums every run).
    chan = tl.program_id(0)
    group = tl.program_id(1)
    k = tl.load(scale_ptr + chan)
    b = tl.load(shift_ptr + chan)
    sum_gx = tl.zeros((BLOCK,), dtype=tl.float32)
    sum_g = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, IMGS):
        img = group * IMGS + i
        for start in range(0, HW, BLOCK):
            pos = start + tl.arange(0, BLOCK)
            live = (pos < HW) & (img < N)
            at = (img * C + chan) * HW + pos
            xv = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
            pre = xv * k + b
            if HAS_RES:
                pre += tl.load(res_ptr + at, mask=live, other=0.0).to(tl.float32)
            gz = tl.where(pre > 0, tl.load(g_ptr + at, mask=live, other=0.0).to(tl.float32), 0.0)
            tl.store(gx_ptr + at, (gz * k).to(gx_ptr.dtype.element_ty), mask=live)
            if HAS_RES:
                tl.store(gres_ptr + at, gz.to(gres_ptr.dtype.element_ty), mask=live)
            sum_gx += gz * xv
            sum_g += gz
    tl.store(dscale_ptr + group * C + chan, tl.sum(sum_gx, axis=0))
    tl.store(dshift_ptr + group * C + chan, tl.sum(sum_g, axis=0))


_JIT: dict[str, object] = {}


def _kernels() -> dict[str, object]:
    if not _JIT:
        triton, _ = load_triton()
        _JIT.update(augment=triton.jit(_augment_kernel), fwd=triton.jit(_bn_relu_kernel),
                    bwd=triton.jit(_bn_relu_bwd_kernel))
    return _JIT


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _ref_augment():
    def augment_normalize(x, oy, ox, flip, mean, std, pad: int = 4):
        k = _kernels()["augment"]
        x = x.contiguous()
        n = x.numel()
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        ints = [t.to(device=x.device, dtype=torch.int32).contiguous() for t in (oy, ox, flip)]
        stats = [t.to(device=x.device, dtype=torch.float32).contiguous() for t in (mean, std)]
        k[(_cdiv(n, 1024),)](x, *ints, *stats, out, n, x.shape[1], x.shape[2], x.shape[3], pad, BLOCK=1024)
        return out

    return augment_normalize


def _ref_bn_relu():
    def bn_relu(x, scale, shift, residual=None):
        k = _kernels()["fwd"]
        x = x.contiguous()
        y = torch.empty_like(x)
        res = residual.contiguous() if residual is not None else x  # a pointer never read without one
        s, b = (t.to(device=x.device, dtype=torch.float32).contiguous() for t in (scale, shift))
        n, c, hw = x.numel(), x.shape[1], x.shape[2] * x.shape[3]
        k[(_cdiv(n, 1024),)](x, s, b, res, y, n, c, hw, HAS_RES=residual is not None, BLOCK=1024)
        return y

    return bn_relu


def _bn_relu_backward(g, x, scale, shift, residual):
    """(grad x, grad scale, grad shift, grad residual or None) from labkit's backward kernel."""
    k = _kernels()["bwd"]
    g, x = g.contiguous(), x.contiguous()
    n, c, hw = x.shape[0], x.shape[1], x.shape[2] * x.shape[3]
    block = min(1024, 1 << max(4, (hw - 1).bit_length()))  # a power of two, at least the plane or 1024
    imgs = 4  # images per program: enough programs to fill a GPU at batch 256 and 64 channels
    groups = _cdiv(n, imgs)
    gx = torch.empty_like(x)
    gres = torch.empty_like(x) if residual is not None else gx
    part = torch.empty(2, groups, c, dtype=torch.float32, device=x.device)
    s, b = (t.to(device=x.device, dtype=torch.float32).contiguous() for t in (scale, shift))
    res = residual.contiguous() if residual is not None else x
    k[(c, groups)](g, x, s, b, res, gx, gres, part[0], part[1], n, c, hw, HAS_RES=residual is not None,
                   IMGS=imgs, BLOCK=block)
    sums = part.sum(1)
    return gx, sums[0].to(scale.dtype), sums[1].to(shift.dtype), (gres if residual is not None else None)


def _ref_function():
    fwd = _ref_bn_relu()

    class BNReLU(torch.autograd.Function):
        """relu(x * scale[c] + shift[c] (+ residual)) with labkit's Triton forward and backward."""

        @staticmethod
        def forward(ctx, inp, k, b, skip=None):
            ctx.save_for_backward(inp, k, b, skip)  # the backward recomputes the pre-activation from these
            return fwd(inp, k, b, skip)

        @staticmethod
        def backward(ctx, grad_out):
            return _bn_relu_backward(grad_out, *ctx.saved_tensors)

    return BNReLU


# ------------------------------------------------------------------------------------ before timing on a GPU

SMALL_TOL = 1e-2  # per-channel sums over half a million terms, added in another order
MAX_SHARE = 1e-5  # the share of elements beyond tolerance that still counts as agreeing (see agreement)


def agreement(got, want, tol: float) -> dict:
    """How far `got` is from `want` (tuples compared part by part): the worst relative error, and the worst share
    of elements off by more than `tol` (relative to 1 + |want|; for a vector of at most 1024 values, such as the
    per-channel sums, to 1 + its largest |want|, within SMALL_TOL).

    A share, not a maximum, decides whether a kernel agrees at millions of elements: a compiled kernel may round
    x * scale + shift once (a fused multiply-add) where eager PyTorch rounds twice, so a pre-activation within a
    rounding of 0 can land on the other side of the ReLU, and its gradient then differs by a whole value."""
    pairs = zip(got, want, strict=True) if isinstance(got, tuple) else [(got, want)]
    worst, share = 0.0, 0.0
    for a, b in pairs:
        if a is None or b is None:
            if a is not b:
                return {"max_rel_error": float("inf"), "share_off": 1.0}
            continue
        a, b = a.detach().float(), b.detach().float()
        if a.shape != b.shape:
            return {"max_rel_error": float("inf"), "share_off": 1.0}
        small = b.numel() <= 1024
        rel = (a - b).abs() / (1 + (b.abs().max() if small else b.abs()))
        worst = max(worst, float(rel.max()) if rel.numel() else 0.0)
        share = max(share, float((rel > (SMALL_TOL if small else tol)).float().mean()) if rel.numel() else 0.0)
    return {"max_rel_error": worst, "share_off": share}


def agrees(got, want, tol: float = 1e-4) -> bool:
    """True when `got` agrees with `want` in all but MAX_SHARE of its elements (see agreement)."""
    return agreement(got, want, tol)["share_off"] <= MAX_SHARE


# ------------------------------------------------------------------------------------ helpers of the checks


def _far(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> float:
    """The largest error beyond tolerance (0 when within atol + rtol x |want| everywhere)."""
    diff = (got.float() - want.float()).abs() - tol * (1 + want.float().abs())
    return float(diff.max().clamp(min=0))


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> bool:
    return got.shape == want.shape and _far(got, want, tol) == 0


def _as_tensor(got, what: str, shape, dtype) -> torch.Tensor:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what} should return a tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(shape):
        raise AssertionError(f"{what} returned shape {tuple(got.shape)}, want {tuple(shape)}")
    if got.dtype != dtype:
        raise AssertionError(f"{what} returned {got.dtype}, want {dtype}")
    return got


def _device() -> torch.device:
    """Where the checks run the student's kernel: the GPU when there is one (compiled), else the CPU (interpreted)."""
    return torch.device("cuda" if torch.cuda.is_available() and not interpreted() else "cpu")


def _first_hint(got: torch.Tensor, variants: dict[str, torch.Tensor], default: str) -> str:
    return next((h for h, v in variants.items() if _close(got, v, 1e-4)), default)


def _where(got: torch.Tensor, want: torch.Tensor) -> str:
    i = int(((got.float() - want.float()).abs()).flatten().argmax())
    at = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), want.shape))
    return f"at index {at} you gave {float(got.flatten()[i]):.6g}, the composition {float(want.flatten()[i]):.6g}"


def _block_hint(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> str | None:
    """The hint for a kernel right on the first positions of every (image, channel) plane and wrong past them, as
    when every program of a plane reads the plane's first block (its block index left out of the offsets, or a
    loop over the plane that does not advance)."""
    if got.dim() != 4 or got.shape != want.shape:
        return None
    hw = want.shape[2] * want.shape[3]
    off = ~((got.float() - want.float()).abs() <= tol * (1 + want.float().abs()))  # NaN (never written) is off
    off = off.reshape(-1, hw).any(0)
    if not bool(off.any()):
        return None
    first = int(off.nonzero()[0])
    if first < 16 or first & (first - 1):  # right up to a power of two, the size of a block
        return None
    return (f"every plane is right on its first {first} positions and wrong past them, as if each program read the "
            f"first block of its plane: offset the positions by the block's index (tl.program_id(1) * BLOCK + "
            f"tl.arange(0, BLOCK)), or, in a loop over the plane, by the loop's start")


# ----------------------------------------------------------------------------------- 7.1 the data path

# (B, C, H, W, pad): odd sizes, pads 2-4; the last plane holds more positions (33 x 35 = 1155) than a block of
# 1024, so a kernel whose programs all read the first block of their plane fails
AUG_CASES = [(3, 3, 5, 7, 2), (2, 3, 8, 8, 4), (5, 2, 9, 6, 3), (2, 2, 33, 35, 4)]


def _aug_inputs(b, c, h, w, pad, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (b, c, h, w), generator=g, dtype=torch.uint8)
    oy = torch.randint(0, 2 * pad + 1, (b,), generator=g)
    ox = torch.randint(0, 2 * pad + 1, (b,), generator=g)
    oy[0], ox[-1] = 0, 2 * pad  # the extreme offsets: all padding on one side
    flip = torch.arange(b) % 2 == 0  # both kinds in every batch
    mean = torch.rand(c, generator=g) * 0.5 + 0.25
    std = torch.rand(c, generator=g) * 0.2 + 0.15
    return x, oy, ox, flip, mean, std


def _aug_hints(got, x, oy, ox, flip, mean, std, pad) -> str:
    f = torch_augment_normalize
    c = x.shape[1]
    inside = f(torch.ones_like(x), oy, ox, flip, torch.zeros(c), torch.ones(c), pad) > 0  # not a padded pixel
    zero_pad = f(x, oy, ox, flip, mean, std, pad).masked_fill(~inside, 0.0)
    return _first_hint(got, {
        "the flip is ignored: mirror image b when flip[b] (column W - 1 - j)": f(x, oy, ox, flip & False, mean, std, pad),
        "the flip is the wrong way round: mirror the images whose flag is set, keep the others":
            f(x, oy, ox, ~flip.bool(), mean, std, pad),
        "rows and columns are swapped: oy is the row offset, ox the column offset": f(x, ox, oy, flip, mean, std, pad),
        "the crop offsets are ignored": f(x, torch.full_like(oy, pad), torch.full_like(ox, pad), flip, mean, std, pad),
        "a padded pixel came out as 0.0: it is a zero *byte*, so it normalizes to (0 - mean) / std": zero_pad,
        "the mean is subtracted in 0-255 units: divide by 255 first, then subtract the mean":
            (f(x, oy, ox, flip, torch.zeros(c), torch.ones(c), pad) - mean.view(1, c, 1, 1) / 255) / std.view(1, c, 1, 1),
        "multiplied by std: divide by it": f(x, oy, ox, flip, mean, torch.ones(c), pad) * std.view(1, c, 1, 1) ** 2,
        "one channel's mean used for every channel: index mean and std by each element's channel c":
            f(x, oy, ox, flip, mean[:1].expand(c), std, pad),
        "one channel's std used for every channel: index mean and std by each element's channel c":
            f(x, oy, ox, flip, mean, std[:1].expand(c), pad),
        "not normalized: out = (x / 255 - mean[c]) / std[c]": f(x, oy, ox, flip, torch.zeros(c), torch.ones(c) / 255, pad),
    }, "out[b, c, i, j] = (xpad[b, c, oy[b] + i, ox[b] + j'] / 255 - mean[c]) / std[c], with j' = W - 1 - j when "
       "flip[b], and xpad the image with `pad` zero bytes on each side")


class _PadWatch(TorchDispatchMode):
    """Records the padding ops PyTorch runs inside the block (F.pad, torch.nn.ZeroPad2d and their kin)."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "pad" in name:  # constant_pad_nd, pad, reflection_pad2d, replication_pad2d, ...
            self.ops.add(name)
        return func(*args, **(kwargs or {}))


@ex.exercise("7.1", "a fused uint8 crop + flip + normalize kernel", reference=_ref_augment)
def check_augment(augment_normalize) -> str:
    """Odd sizes and pads against torch_augment_normalize, within TOL; a Triton kernel must have run."""
    load_triton()
    for k, (b, c, h, w, pad) in enumerate(AUG_CASES):
        x, oy, ox, flip, mean, std = _aug_inputs(b, c, h, w, pad, seed=70 + k)
        on = [t.to(_device()) for t in (x, oy, ox, flip, mean, std)]
        with count_launches() as n, _PadWatch() as padded:
            got = augment_normalize(*on, pad)
        _no_kernel(n, "augment_normalize")
        if padded.ops:
            raise AssertionError(f"augment_normalize built the padded batch ({', '.join(sorted(padded.ops))}): that "
                                 "writes and reads a second, larger copy of the batch, the traffic the kernel is "
                                 "there to save. Index the unpadded input (row oy[b] + i - pad) and load a zero "
                                 "where it falls outside (tl.load(..., mask=inside, other=0))")
        got = _as_tensor(got, f"augment_normalize on a {b}x{c}x{h}x{w} batch", (b, c, h, w), torch.float32).cpu()
        if not torch.equal(on[0].cpu(), x):
            raise AssertionError("augment_normalize changed its input batch: write into a new output tensor")
        want = torch_augment_normalize(x, oy, ox, flip, mean, std, pad)
        if not _close(got, want):
            hint = _block_hint(got, want) or _aug_hints(got, x, oy, ox, flip, mean, std, pad)
            raise AssertionError(f"a {b}x{c}x{h}x{w} batch, pad {pad}: {_where(got, want)}. Hint: {hint}")
    return (f"{len(AUG_CASES)} odd-sized batches (pads 2-4, extreme offsets, flipped and not) match the PyTorch "
            f"composition within {TOL:g}")


# ------------------------------------------------------------------------------ 7.2 BatchNorm-apply + ReLU

# (N, C, H, W, with a residual); the last plane, 33 x 35, is more than a block of 1024 positions (see AUG_CASES)
BN_CASES = [(2, 4, 5, 7, True), (3, 3, 4, 4, False), (1, 5, 3, 9, True), (2, 3, 33, 35, True)]


def _bn_inputs(n, c, h, w, seed, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=g)
    scale = torch.randn(c, generator=g)  # some negative: BatchNorm's weight can be
    shift = torch.randn(c, generator=g) * 0.5
    res = torch.randn(n, c, h, w, generator=g)
    return [t.requires_grad_(grad) for t in (x, scale, shift, res)]


def _bn_hints(got, x, scale, shift, res) -> str:
    c = x.shape[1]
    z = x * scale.view(1, c, 1, 1) + shift.view(1, c, 1, 1)
    last = (x.flatten() * scale.repeat(x.numel() // c) + shift.repeat(x.numel() // c)).view_as(x)
    r = 0 if res is None else res
    variants = {"no ReLU: negatives must become 0": z + r,
                "the channel is indexed as channels_last's offset % C: in NCHW it is (offset // (H * W)) % C":
                    torch.relu(last + r)}
    if res is not None:
        variants |= {"the residual is ignored: add it before the ReLU": torch.relu(z),
                     "the residual is added after the ReLU: a ResNet block adds it before": torch.relu(z) + res}
    return _first_hint(got, variants, "y = relu(x * scale[c] + shift[c] + residual), c the channel of each element")


@ex.exercise("7.2", "BatchNorm-apply + residual + ReLU, fused", reference=_ref_bn_relu)
def check_bn_relu(bn_relu) -> str:
    """NCHW float32 batches, with and without a residual, against torch_bn_relu within TOL."""
    load_triton()
    for k, (n, c, h, w, with_res) in enumerate(BN_CASES):
        x, scale, shift, res = _bn_inputs(n, c, h, w, seed=72 + k)
        res = res if with_res else None
        on = [None if t is None else t.to(_device()) for t in (x, scale, shift, res)]
        with count_launches() as launched:
            got = bn_relu(*on)
        _no_kernel(launched, "bn_relu")
        what = f"bn_relu on {n}x{c}x{h}x{w}{' with a residual' if with_res else ''}"
        got = _as_tensor(got, what, x.shape, torch.float32).cpu()
        if not torch.equal(on[0].cpu(), x):
            raise AssertionError("bn_relu changed x in place: write y into a new tensor (torch.empty_like(x))")
        want = torch_bn_relu(x, scale, shift, res)
        if not _close(got, want):
            hint = _block_hint(got, want) or _bn_hints(got, x, scale, shift, res)
            raise AssertionError(f"{what}: {_where(got, want)}. Hint: {hint}")
    _check_bn_relu_bf16(bn_relu)
    return (f"{len(BN_CASES)} NCHW batches, with and without a residual, match relu(x * scale + shift + r) within "
            f"{TOL:g}; a bf16 batch comes back bf16, within one bf16 unit of the float32 result")


def _check_bn_relu_bf16(bn_relu) -> None:
    """bf16 activations in, bf16 out, within one unit in bf16's last place (2**-7 relative) of the float32 result."""
    x, scale, shift, res = _bn_inputs(2, 3, 4, 5, seed=79)
    x, res = x.to(torch.bfloat16), res.to(torch.bfloat16)
    on = [t.to(_device()) for t in (x, scale, shift, res)]
    got = _as_tensor(bn_relu(*on), "bn_relu on a 2x3x4x5 bf16 batch with a residual", x.shape, torch.bfloat16)
    want = torch_bn_relu(x.float(), scale, shift, res.float())
    # a unit, not half of one: Triton's interpreter converts float32 to bf16 by truncation, a GPU rounds
    err = ((got.cpu().float() - want).abs() / want.abs().clamp_min(2.0 ** -6)).max().item()
    if err > 2.0 ** -7 * 1.01:
        raise AssertionError(f"bn_relu on a bf16 batch is up to {err:.2g} (relative) off the float32 result, more "
                             "than one bf16 rounding: load each input .to(tl.float32), compute in float32 and "
                             "convert only the stored value (.to(y_ptr.dtype.element_ty))")


# ------------------------------------------------------------------------------------------ 7.3 backward


def _grads(fn, x, scale, shift, res, g):
    ins = [t for t in (x, scale, shift, res) if t is not None]
    for t in ins:
        t.grad = None
    y = fn(x, scale, shift, res)
    y.backward(g)
    return y.detach(), [None if t is None else t.grad for t in (x, scale, shift, res)]


def _grad_hint(name: str) -> str:
    return {"x": "grad_x = grad_out * (z > 0) * scale[c], z = x * scale[c] + shift[c] (+ residual) the "
                 "pre-activation (ReLU passes the gradient only where z > 0)",
            "scale": "grad_scale[c] = the sum over the batch and positions of channel c of grad_out * (z > 0) * x",
            "shift": "grad_shift[c] = the sum over channel c of grad_out * (z > 0)",
            "residual": "grad_residual = grad_out * (z > 0): the residual enters z with weight 1"}[name]


@ex.exercise("7.3", "the fused kernel's backward, as an autograd.Function", reference=_ref_function)
def check_backward(BNReLU) -> str:
    """Outputs and the four gradients against autograd on torch_bn_relu; the backward must launch a kernel."""
    load_triton()
    if not (isinstance(BNReLU, type) and issubclass(BNReLU, torch.autograd.Function)):
        raise AssertionError(f"pass the class itself, a subclass of torch.autograd.Function, got {BNReLU!r}")
    skipped = set()
    for k, (n, c, h, w, with_res) in enumerate(BN_CASES):
        x, scale, shift, res = _bn_inputs(n, c, h, w, seed=73 + k, grad=True)
        res = res if with_res else None
        g = torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(k))
        want_y, want = _grads(torch_bn_relu, x, scale, shift, res, g)
        on = [None if t is None else t.detach().to(_device()).requires_grad_() for t in (x, scale, shift, res)]
        y = BNReLU.apply(*on)
        what = f"{n}x{c}x{h}x{w}{' with a residual' if with_res else ''}"
        if not isinstance(y, torch.Tensor) or y.grad_fn is None or BNReLU.__name__ not in type(y.grad_fn).__name__:
            raise AssertionError(f"BNReLU.apply(...) should return a tensor whose grad_fn is your Function's "
                                 f"backward, got {type(getattr(y, 'grad_fn', None)).__name__}")
        if not _close(y.detach().cpu(), want_y):
            raise AssertionError(f"{what}: the forward differs, {_where(y.detach().cpu(), want_y)} (exercise 7.2)")
        with count_launches() as launched:
            y.backward(g.to(y.device))
        _no_kernel(launched, "BNReLU.backward")
        for name, got, ref in zip(("x", "scale", "shift", "residual"), [None if t is None else t.grad for t in on], want, strict=True):
            if ref is None:
                continue
            if got is None and name in ("scale", "shift"):
                skipped.add(name)  # the optional part
                continue
            if got is None:
                raise AssertionError(f"{what}: no gradient for {name}; backward returns one per forward input")
            got = got.cpu()
            if got.shape != ref.shape or not _close(got, ref, GRAD_TOL):
                shape = "" if got.shape == ref.shape else f" (shape {tuple(got.shape)}, want {tuple(ref.shape)})"
                hint = (_block_hint(got, ref, GRAD_TOL) if name in ("x", "residual") else None) or _grad_hint(name)
                raise AssertionError(f"{what}: the gradient of {name} differs{shape}"
                                     f"{'' if shape else ', ' + _where(got, ref)}. Hint: {hint}")
    done = "x, residual" + ("" if skipped else ", scale and shift")
    return (f"{len(BN_CASES)} batches: the forward and the gradients of {done} match autograd on the PyTorch "
            f"composition within {GRAD_TOL:g}" + (f"; the gradients of {' and '.join(sorted(skipped))} were not "
                                                  "computed (the optional part)" if skipped else ""))


# ------------------------------------------------------------------------------------- 7.4 bytes moved

KERNELS = ("augment_normalize", "bn_relu", "bn_relu_backward")
# Arithmetic per output element, each add, multiply, divide or max one FLOP: the x-axis of the roofline.
FLOPS_PER_ELEMENT = {"augment_normalize": 3,  # / 255, - mean, / std
                     "bn_relu": 3,  # * scale, + shift, max; +1 with a residual
                     "bn_relu_backward": 6}  # z = x*k + b, the select, grad * k, the two sums; +1 with a residual


def bytes_moved(kernel: str, numel: int, itemsize: int = 4, residual: bool = False) -> int:
    """Bytes a kernel of this week reads and writes, each tensor once (the per-channel and per-image vectors left
    out: they are a fraction of a percent). `numel` elements of the activation; `itemsize` bytes per float."""
    if kernel not in KERNELS:
        raise LabkitError(f"unknown kernel {kernel!r}: one of {', '.join(KERNELS)}")
    if kernel == "augment_normalize":
        return numel * (1 + itemsize)  # uint8 in, float out
    if kernel == "bn_relu":
        return numel * itemsize * (2 + residual)  # x (and the residual) in, y out
    return numel * itemsize * (3 + 2 * residual)  # grad_out, x (, residual) in; grad_x (, grad_residual) out


def flops(kernel: str, numel: int, residual: bool = False) -> int:
    """FLOPs of a kernel of this week over `numel` elements (FLOPS_PER_ELEMENT, one more with a residual)."""
    if kernel not in KERNELS:
        raise LabkitError(f"unknown kernel {kernel!r}: one of {', '.join(KERNELS)}")
    return numel * (FLOPS_PER_ELEMENT[kernel] + (residual and kernel != "augment_normalize"))


BYTES_CASES = [("augment_normalize", 4096 * 3 * 32 * 32, 4, False), ("augment_normalize", 4096 * 3 * 32 * 32, 2, False),
               ("bn_relu", 512 * 64 * 32 * 32, 4, False), ("bn_relu", 512 * 64 * 32 * 32, 2, True),
               ("bn_relu_backward", 512 * 64 * 32 * 32, 4, False), ("bn_relu_backward", 512 * 128 * 16 * 16, 2, True)]


def _bytes_hint(got: float, kernel: str, numel: int, itemsize: int, residual: bool) -> str:
    want = bytes_moved(kernel, numel, itemsize, residual)
    e = numel * itemsize
    hints = {want / 1e9: "return bytes, not GB",
             e * (2 if kernel == "augment_normalize" else 1): "the uint8 input is 1 byte per element, not itemsize",
             want - e * residual * (2 if kernel == "bn_relu_backward" else 1):
                 "the residual is a tensor too: read once (and, in the backward, its gradient written once)",
             want + e: "the worked backward recomputes z from x (and the residual): it never reads y",
             want - numel * (itemsize if kernel == "augment_normalize" else 0): "count the output written, too"}
    hints.pop(want, None)
    return next((h for v, h in hints.items() if v and abs(got - v) <= 0.01 * v),
                "each tensor the kernel touches, read or written once, times its bytes per element")


def _ref_bytes():
    return bytes_moved


@ex.exercise("7.4", "bytes moved by each kernel, for the roofline", reference=_ref_bytes)
def check_bytes(fn) -> str:
    """Each kernel at realistic sizes, fp32 and 16-bit, with and without a residual: within 1% of bytes_moved."""
    for kernel, numel, itemsize, residual in BYTES_CASES:
        got = fn(kernel, numel, itemsize=itemsize, residual=residual)
        if not isinstance(got, int | float) or isinstance(got, bool):
            raise AssertionError(f"return a number of bytes, got {type(got).__name__}")
        want = bytes_moved(kernel, numel, itemsize, residual)
        if abs(got - want) > 0.01 * want:
            raise AssertionError(f"{kernel} on {numel:,} elements of {itemsize} bytes"
                                 f"{' with a residual' if residual else ''}: {want:,} bytes, yours {got:,.0f}. Hint: "
                                 f"{_bytes_hint(got, kernel, numel, itemsize, residual)}")
    return f"{len(BYTES_CASES)} cases within 1% of each tensor counted once"
