"""Batching variable-length sequences: padding waste and what it costs a model.

A synthetic token corpus with a long-tailed (log-normal) length distribution, and four ways to batch it:

- `max`: pad every sequence to the corpus maximum (a fixed shape, the most waste);
- `dynamic`: pad each random batch to its own longest sequence (`pad_collate` as the DataLoader's collate_fn);
- `bucket`: `BucketBatchSampler` sorts by length inside large random chunks, cuts batches there and shuffles
  the batches: neighbours have similar lengths, so little padding, and batches stay random;
- `pack`: `pack_rows` fills fixed-length rows with whole sequences (best-fit decreasing); `TinyEncoder`
  then keeps the sequences of a row apart with a block-diagonal attention mask and per-sequence positions.

Every strategy yields every sequence exactly once per epoch. `strategy_table` measures padding waste (share of
pad tokens) and real tokens/s of a small transformer's forward + backward on each strategy's batches.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit import data as D
from labkit.env import LabkitError, pick_device

PAD = 0
STRATEGIES = ("max", "dynamic", "bucket", "pack")


@dataclass
class Corpus:
    """Token sequences (int64 arrays, ids 1..vocab-1; 0 is the pad id) and their lengths."""

    seqs: list[np.ndarray]
    vocab: int

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(s) for s in self.seqs], dtype=np.int64)

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i]


def synthetic_corpus(n: int = 20_000, seed: int = 0, vocab: int = 8192, median_len: float = 40.0,
                     sigma: float = 0.9, min_len: int = 4, max_len: int = 512) -> Corpus:
    """A seeded corpus of `n` sequences with log-normal lengths (median `median_len` tokens, clipped to
    [min_len, max_len]) and Zipf-distributed token ids, like sentences or documents of real text.

    With the defaults the mean is ~1.5x the median and the longest sequences are ~10x the median: a long tail.
    """
    if n < 1 or vocab < 2 or not 1 <= min_len <= max_len:
        raise LabkitError(f"synthetic_corpus needs n >= 1, vocab >= 2 and 1 <= min_len <= max_len "
                          f"(got n={n}, vocab={vocab}, min_len={min_len}, max_len={max_len})")
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(np.log(median_len), sigma, n)), min_len, max_len).astype(np.int64)
    tokens = np.minimum(rng.zipf(1.3, int(lengths.sum())), vocab - 1).astype(np.int64)
    return Corpus(np.split(tokens, np.cumsum(lengths)[:-1]), vocab)


def corpus_size(quick: bool) -> dict:
    """synthetic_corpus arguments for a quick CPU run or a full GPU run."""
    return dict(n=512, median_len=16, max_len=128) if quick else dict(n=20_000, median_len=40, max_len=512)


class TokenBatch(NamedTuple):
    """A batch of token rows: tokens (B, L), segments (B, L: 0 = pad, k >= 1 = k-th sequence of the row),
    positions (B, L: position inside its own sequence), and whether rows hold several sequences (packed)."""

    tokens: torch.Tensor
    segments: torch.Tensor
    positions: torch.Tensor
    packed: bool = False  # known on the host, so the model picks its mask without reading the device

    @property
    def real_tokens(self) -> int:
        return int((self.segments > 0).sum())

    @property
    def padded_tokens(self) -> int:
        return self.tokens.numel()

    def to(self, device, non_blocking: bool = False) -> TokenBatch:
        return TokenBatch(*(t.to(device, non_blocking=non_blocking) for t in self[:3]), self.packed)


class TokenDataset(torch.utils.data.Dataset):
    """Map-style view of a corpus: item i is sequence i as an int64 tensor."""

    def __init__(self, corpus: Corpus):
        self.corpus = corpus

    def __len__(self):
        return len(self.corpus)

    def __getitem__(self, i):
        return torch.from_numpy(self.corpus[i])


def pad_collate(batch: list[torch.Tensor], pad_to: int | None = None) -> TokenBatch:
    """Stack sequences into one padded TokenBatch: to the longest in the batch, or to `pad_to` tokens."""
    longest = max(len(s) for s in batch)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise LabkitError(f"pad_to={pad_to} is shorter than a sequence of {longest} tokens: pad to the corpus max")
    tokens = torch.full((len(batch), width), PAD, dtype=torch.int64)
    segments = torch.zeros((len(batch), width), dtype=torch.int64)
    for r, s in enumerate(batch):
        tokens[r, :len(s)] = s
        segments[r, :len(s)] = 1
    positions = torch.arange(width).expand(len(batch), width).clone()
    return TokenBatch(tokens, segments, positions)


def _epoch_perm(n: int, seed: int, epoch: int) -> list[int]:
    return D.epoch_order(n, seed, epoch).tolist()


class _Epochs:
    """Each iter() is the next epoch (the first is 0); set_epoch picks the epoch the next iter() yields."""

    _next = 0

    def set_epoch(self, epoch: int):
        self._next = epoch

    def _advance(self) -> int:
        epoch = self._next
        self._next += 1
        return epoch


class BucketBatchSampler(_Epochs, torch.utils.data.Sampler):
    """Length bucketing: batches of indices with similar lengths, every index exactly once per epoch.

    Each epoch: shuffle (labkit.data.epoch_order), cut into chunks of `batch_size * chunk_batches` indices,
    sort each chunk by length, cut it into batches, shuffle the batch order. Bigger chunks mean less padding
    but less random batches. At most the epoch's last batch is partial (dropped with `drop_last`).
    """

    def __init__(self, lengths, batch_size: int, seed: int = 0, chunk_batches: int = 64, drop_last: bool = False):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if batch_size < 1 or chunk_batches < 1:
            raise LabkitError(f"batch_size and chunk_batches must be >= 1 (got {batch_size}, {chunk_batches})")
        if self.lengths.ndim != 1 or len(self.lengths) == 0:
            raise LabkitError("lengths must be a non-empty list of sequence lengths")
        self.batch_size, self.chunk, self.seed, self.drop_last = batch_size, batch_size * chunk_batches, seed, drop_last

    def batches(self, epoch: int) -> list[list[int]]:
        """The batches of `epoch` (without advancing the sampler)."""
        perm = _epoch_perm(len(self.lengths), self.seed, epoch)
        out = []
        for s in range(0, len(perm), self.chunk):
            chunk = sorted(perm[s:s + self.chunk], key=self.lengths.__getitem__)  # stable: ties keep random order
            out += [chunk[i:i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
        if self.drop_last and len(out[-1]) < self.batch_size:
            out.pop()
        g = torch.Generator().manual_seed(self.seed * 7919 + epoch + 1)
        return [out[i] for i in torch.randperm(len(out), generator=g).tolist()]

    def __iter__(self):
        return iter(self.batches(self._advance()))

    def __len__(self):
        n, bs = len(self.lengths), self.batch_size
        return n // bs if self.drop_last else -(-n // bs)


def pack_rows(lengths, pack_len: int, order=None) -> list[list[int]]:
    """Whole sequences packed into rows of at most `pack_len` tokens, best-fit decreasing.

    Longest first (ties in `order`, default index order); each goes into the fullest row it still fits.
    Every index lands in exactly one row; a sequence longer than pack_len is an error, not a silent cut.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.max() > pack_len:
        raise LabkitError(f"a sequence of {lengths.max()} tokens does not fit pack_len={pack_len}: raise pack_len "
                          f"to the corpus max")
    order = list(range(len(lengths))) if order is None else list(order)
    order.sort(key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted: the fullest row that fits is found by bisect
    for i in order:
        need = int(lengths[i])
        k = bisect.bisect_left(free, (need, -1))
        if k == len(free):
            rows.append([i])
            bisect.insort(free, (pack_len - need, len(rows) - 1))
        else:
            room, r = free.pop(k)
            rows[r].append(i)
            bisect.insort(free, (room - need, r))
    return rows


class PackedBatches(_Epochs, torch.utils.data.Sampler):
    """Batches of packed rows (lists of rows of indices); rows are re-packed and shuffled every epoch."""

    def __init__(self, lengths, pack_len: int, rows_per_batch: int, seed: int = 0):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if rows_per_batch < 1:
            raise LabkitError(f"rows_per_batch must be >= 1, not {rows_per_batch}")
        self.pack_len, self.rows_per_batch, self.seed = pack_len, rows_per_batch, seed

    def batches(self, epoch: int) -> list[list[list[int]]]:
        rows = pack_rows(self.lengths, self.pack_len, _epoch_perm(len(self.lengths), self.seed, epoch))
        g = torch.Generator().manual_seed(self.seed * 7919 + epoch + 1)
        rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
        return [rows[i:i + self.rows_per_batch] for i in range(0, len(rows), self.rows_per_batch)]

    def __iter__(self):
        return iter(self.batches(self._advance()))

    def __len__(self):
        return len(self.batches(self._next))  # rows per epoch vary slightly with the packing order


class PackedRows(torch.utils.data.Dataset):
    """Batch-level dataset for packing: item = a list of rows of indices -> one TokenBatch of (rows, pack_len)."""

    def __init__(self, corpus: Corpus, pack_len: int):
        self.corpus, self.pack_len = corpus, pack_len

    def __len__(self):
        return len(self.corpus)

    def __getitem__(self, rows):
        tokens = torch.full((len(rows), self.pack_len), PAD, dtype=torch.int64)
        segments = torch.zeros_like(tokens)
        positions = torch.zeros_like(tokens)
        for r, row in enumerate(rows):
            at = 0
            for k, i in enumerate(row, start=1):
                s = torch.from_numpy(self.corpus[i])
                tokens[r, at:at + len(s)] = s
                segments[r, at:at + len(s)] = k
                positions[r, at:at + len(s)] = torch.arange(len(s))
                at += len(s)
        return TokenBatch(tokens, segments, positions, packed=True)


class TokenLoader:
    """A DataLoader for one batching strategy; each iter() is the next epoch of TokenBatch es."""

    def __init__(self, strategy: str, corpus: Corpus, batch_size: int = 32, seed: int = 0,
                 pack_len: int | None = None, workers: int = 0, chunk_batches: int = 64):
        if strategy not in STRATEGIES:
            raise LabkitError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
        if batch_size < 1:
            raise LabkitError(f"batch_size must be >= 1, not {batch_size}")
        lengths = corpus.lengths
        self.strategy, self.max_len = strategy, int(lengths.max())
        self.pack_len = pack_len or self.max_len
        ds = TokenDataset(corpus)
        kw = dict(num_workers=workers)
        if strategy in ("max", "dynamic"):
            self.sampler = D.EpochSampler(len(corpus), seed)
            collate = functools.partial(pad_collate, pad_to=self.max_len if strategy == "max" else None)
            self.loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=self.sampler,
                                                      collate_fn=collate, **kw)
        elif strategy == "bucket":
            self.sampler = BucketBatchSampler(lengths, batch_size, seed, chunk_batches)
            self.loader = torch.utils.data.DataLoader(ds, batch_sampler=self.sampler, collate_fn=pad_collate, **kw)
        else:
            # Rows per batch chosen so that a batch holds about as many real tokens as batch_size sequences.
            rows = max(1, round(batch_size * float(lengths.mean()) / self.pack_len))
            self.sampler = PackedBatches(lengths, self.pack_len, rows, seed)
            self.loader = torch.utils.data.DataLoader(PackedRows(corpus, self.pack_len), batch_size=None,
                                                      sampler=self.sampler, **kw)
        self._epoch = 0

    def set_epoch(self, epoch: int):
        self._epoch = epoch

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        self.sampler.set_epoch(self._epoch)
        self._epoch += 1
        return iter(self.loader)


def padding_waste(batches) -> float:
    """Share of pad tokens among all tokens of these TokenBatch es (0: no padding)."""
    real = sum(b.real_tokens for b in batches)
    total = sum(b.padded_tokens for b in batches)
    return 1 - real / total


def index_waste(batches: list[list[int]], lengths, pad_to: int | None = None) -> float:
    """Padding waste of batches of indices padded to their longest (or to `pad_to`), without building tensors."""
    lengths = np.asarray(lengths)
    real = sum(int(lengths[b].sum()) for b in batches)
    total = sum(len(b) * (pad_to or int(lengths[b].max())) for b in batches)
    return 1 - real / total


# ------------------------------------------------------------------------------------------------ the model


class TinyEncoder(nn.Module):
    """Token + position embeddings, one transformer encoder layer, a per-token head: padding costs real compute.

    Padded rows mask pad keys; packed rows (several segments) get a block-diagonal mask, so a token never
    attends to another sequence of its row, and positions restart at each sequence: a sequence's outputs are
    the same alone, padded or packed.
    """

    def __init__(self, vocab: int, d_model: int = 64, nhead: int = 4, ff: int = 128, max_len: int = 512,
                 classes: int = 16):
        super().__init__()
        self.nhead, self.classes = nhead, classes
        self.tok = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, d_model)
        self.layer = nn.TransformerEncoderLayer(d_model, nhead, ff, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d_model, classes)

    def hidden(self, b: TokenBatch) -> torch.Tensor:
        """Per-token outputs (B, L, d_model) of the encoder layer."""
        x = self.tok(b.tokens) + self.pos(b.positions)
        seg = b.segments
        if not b.packed:  # one sequence per row: a key-padding mask is enough (and cheaper)
            return self.layer(x, src_key_padding_mask=seg == 0)
        same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
        same |= torch.eye(seg.shape[1], dtype=torch.bool, device=seg.device)  # pad queries see themselves: no NaN
        return self.layer(x, src_mask=(~same).repeat_interleave(self.nhead, 0))

    def loss(self, b: TokenBatch) -> torch.Tensor:
        """Mean cross-entropy over real tokens of a toy per-token task (predict token id mod `classes`)."""
        logits = self.head(self.hidden(b))
        target = torch.where(b.segments > 0, b.tokens % self.classes, -100)
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def model_size(quick: bool) -> dict:
    """TinyEncoder arguments for a quick CPU run or a full GPU run."""
    return dict(d_model=32, nhead=2, ff=64) if quick else dict(d_model=128, nhead=4, ff=512)


def strategy_table(corpus: Corpus, device="cpu", batch_size: int | None = None, quick: bool = True,
                   strategies=STRATEGIES, warmup: int = 1, repeats: int = 2, seed: int = 0, progress=None,
                   threads: int | None = 1) -> list[dict]:
    """Per strategy: batches, real and padded tokens, padding waste, and real tokens/s of TinyEncoder's
    forward + backward over one epoch of that strategy's batches (already collated, on the device).

    Timed through labkit.bench.time_fn with `threads` CPU intra-op threads (None: unchanged; the default 1
    suits a tiny model, whose small ops only stall when handed between threads); `speedup` is tokens/s over
    the 'max' strategy's (when it ran).
    """
    from labkit.bench import time_fn, torch_threads

    dev = pick_device(device)
    batch_size = batch_size or (32 if quick else 64)
    lengths = corpus.lengths
    torch.manual_seed(seed)
    model = TinyEncoder(corpus.vocab, max_len=int(lengths.max()), **model_size(quick)).to(dev)
    rows = []
    for s in strategies:
        loader = TokenLoader(s, corpus, batch_size, seed)
        batches = [b.to(dev) for b in loader]
        real = sum(b.real_tokens for b in batches)
        if real != int(lengths.sum()):
            raise AssertionError(f"{s}: an epoch holds {real} real tokens, the corpus {int(lengths.sum())}")

        def epoch(batches=batches):
            for b in batches:
                model.loss(b).backward()
            model.zero_grad(set_to_none=True)

        with torch_threads(threads):
            t = time_fn(epoch, device=dev, warmup=warmup, repeats=repeats)
        rows.append({"strategy": s, "batches": len(batches), "shape_examples": [list(b.tokens.shape) for b in batches[:3]],
                     "real_tokens": real, "padded_tokens": sum(b.padded_tokens for b in batches),
                     "padding_waste": padding_waste(batches), "tokens_per_s": real / t.median,
                     "epoch_s": t.median, "epoch_iqr_s": t.iqr})
        if progress is not None:
            progress.update(1)
    base = next((r["tokens_per_s"] for r in rows if r["strategy"] == "max"), None)
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base if base else None
    return rows


def strategy_markdown(rows: list[dict]) -> str:
    """A Markdown table of `strategy_table` rows."""
    lines = ["| strategy | batches | padded tokens | padding waste | real tokens/s | vs max |", "|---|---|---|---|---|---|"]
    for r in rows:
        sp = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
        lines.append(f"| {r['strategy']} | {r['batches']} | {r['padded_tokens']:,} | {100 * r['padding_waste']:.1f}% | "
                     f"{r['tokens_per_s']:,.0f} | {sp} |")
    return "\n".join(lines)


def plot_strategies(rows: list[dict], axes=None):
    """Two bar charts side by side: padding waste and real tokens/s per strategy."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    names = [r["strategy"] for r in rows]
    axes[0].bar(names, [100 * r["padding_waste"] for r in rows], color="#d8703b")
    axes[0].set_ylabel("% of tokens that are padding")
    axes[0].set_title("padding waste")
    axes[1].bar(names, [r["tokens_per_s"] for r in rows], color="#3b7dd8")
    axes[1].set_ylabel("real tokens/s (forward + backward)")
    axes[1].set_title("throughput")
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    return axes


def plot_lengths(corpus: Corpus, ax=None):
    """Histogram of sequence lengths (log count): the long tail that makes padding expensive."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    lengths = corpus.lengths
    ax.hist(lengths, bins=60, color="#555")
    ax.set_yscale("log")
    for q, c in ((0.5, "C0"), (0.99, "C3")):
        v = np.quantile(lengths, q)
        ax.axvline(v, color=c, ls="--", label=f"p{int(q * 100)} = {v:.0f}")
    ax.axvline(lengths.max(), color="k", ls=":", label=f"max = {lengths.max()}")
    ax.set_xlabel("tokens per sequence")
    ax.set_ylabel("sequences")
    ax.legend(fontsize=8)
    return ax
