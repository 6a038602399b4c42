"""Week 4's exercise checks catch the mistakes a student makes, each with a message that says what differed."""

import random

import numpy as np
import pytest
import torch

from labkit import bucketing as B
from labkit import data as D
from labkit import exercises as ex
from labkit import week4_exercises as W4


def _wrong(eid, answer, match):
    with pytest.raises(ex.Wrong, match=match):
        ex.check(eid, answer, quiet=True)


def test_every_reference_passes():
    for eid in ("4.2", "4.4", "4.6", "4.7", "4.8"):
        assert "right" in ex.check(eid, ex.reference(eid), quiet=True)


# ---------------------------------------------------------------------------------------------- 4.2


def _loader(**over):
    """A make_loader that sets what the exercise asks except for `over`."""

    def seed_worker(_):
        s = torch.initial_seed() % 2**32
        np.random.seed(s)
        random.seed(s)

    def make_loader(dataset, batch_size, num_workers, seed):
        kw = dict(batch_size=batch_size, shuffle=True, num_workers=num_workers, pin_memory=torch.cuda.is_available(),
                  generator=torch.Generator().manual_seed(seed))
        if num_workers:
            kw.update(persistent_workers=True, prefetch_factor=4, worker_init_fn=seed_worker)
        kw.update(over)
        if kw.get("generator", 0) is None:
            kw.pop("generator")
        return torch.utils.data.DataLoader(dataset, **kw)

    return make_loader


def test_loader_settings_and_behaviour_are_checked():
    _wrong("4.2", _loader(shuffle=False), "shuffled")
    _wrong("4.2", _loader(generator=None), "generator")
    _wrong("4.2", _loader(prefetch_factor=2), "prefetch_factor")

    def not_persistent(dataset, batch_size, num_workers, seed):
        dl = _loader()(dataset, batch_size, num_workers, seed)
        if num_workers:
            return _loader(persistent_workers=False)(dataset, batch_size, num_workers, seed)
        return dl

    _wrong("4.2", not_persistent, "persistent_workers")
    _wrong("4.2", _loader(worker_init_fn=lambda _: np.random.seed(0)), "worker_init_fn|same NumPy")
    _wrong("4.2", lambda *a: list(range(3)), "DataLoader")


# ---------------------------------------------------------------------------------------------- 4.4


def test_prefetch_must_run_one_ahead_and_name_the_cuda_calls():
    def not_ahead(batches, device):
        # mentions cuda.Stream pin_memory non_blocking=True wait_stream record_stream, but yields before fetching
        for b in batches:
            yield tuple(t.to(device) for t in b)

    _wrong("4.4", not_ahead, "one ahead")

    def no_streams(batches, device):
        it = iter(batches)
        nxt = next(it, None)
        while nxt is not None:
            cur, nxt = tuple(t.to(device) for t in nxt), next(it, None)
            yield cur

    _wrong("4.4", no_streams, r"side stream \(torch.cuda.Stream\)")

    def drops_one(batches, device):
        batches = list(batches)
        yield from ex.reference("4.4")(batches[:-1], device)

    _wrong("4.4", drops_one, "batches in|taken")


def test_prefetch_verdict_says_what_a_cpu_skips():
    if torch.cuda.is_available():
        pytest.skip("on a GPU nothing is skipped")
    assert "skipped without CUDA" in ex.check("4.4", ex.reference("4.4"), quiet=True)


# ---------------------------------------------------------------------------------------------- 4.6


def test_augment_catches_loops_global_rng_and_wrong_crops():
    def per_image(x, generator):
        return torch.stack([D.augment_batch(im[None], generator)[0] for im in x])

    _wrong("4.6", per_image, "Python loop")

    def global_rng(x, generator):
        return D.augment_batch(x, None)

    _wrong("4.6", global_rng, "global RNG")

    def never_flips(x, generator):
        oy = torch.randint(0, 9, (len(x),), generator=generator)
        ox = torch.randint(0, 9, (len(x),), generator=generator)
        return W4._crop_flip(x, oy, ox, torch.zeros(len(x), dtype=torch.bool))

    _wrong("4.6", never_flips, "flipped|Python loop")

    def small_offsets(x, generator):
        oy = torch.randint(0, 5, (len(x),), generator=generator)
        ox = torch.randint(0, 9, (len(x),), generator=generator)
        fl = torch.rand(len(x), generator=generator) < 0.5
        return W4._crop_flip(x, oy, ox, fl)

    _wrong("4.6", small_offsets, "vertical offsets|Python loop")

    def wrong_shape(x, generator):
        return D.augment_batch(x, generator)[:, :, :30]

    _wrong("4.6", wrong_shape, "shape")


def test_the_crop_decoder_agrees_with_labkits_own_draws():
    x = W4._coded(64)
    g = torch.Generator().manual_seed(7)
    out = D.augment_batch(x, g)
    oy, ox, flip = W4._decode_crops(out)
    assert torch.equal(W4._crop_flip(x, oy, ox, flip), out)


# ------------------------------------------------------------------------------------------- 4.7, 4.8


def test_collate_catches_padding_to_the_corpus_max_and_a_wrong_mask():
    def to_max(seqs):
        b = B.pad_collate(list(seqs), pad_to=200)
        return b.tokens, b.segments > 0

    _wrong("4.7", to_max, "longest in this batch")

    def mask_all(seqs):
        b = B.pad_collate(list(seqs))
        return b.tokens, torch.ones_like(b.tokens, dtype=torch.bool)

    _wrong("4.7", mask_all, "mask")

    def pad_minus_one(seqs):
        b = B.pad_collate(list(seqs))
        return torch.where(b.segments > 0, b.tokens, -1), b.segments > 0

    _wrong("4.7", pad_minus_one, "pad id")


def test_bucketing_catches_missing_shuffles_and_a_global_sort():
    ref = ex.reference("4.8")

    def sorted_order(lengths, batch_size, seed, epoch, chunk_batches=64):
        bat = ref(lengths, batch_size, seed, epoch, chunk_batches)
        return sorted(bat, key=lambda b: float(np.mean(np.asarray(lengths)[b])))

    _wrong("4.8", sorted_order, "shuffle the batches' order")

    def no_epoch(lengths, batch_size, seed, epoch, chunk_batches=64):
        return ref(lengths, batch_size, seed, 0, chunk_batches)

    _wrong("4.8", no_epoch, "epoch")

    def random_batches(lengths, batch_size, seed, epoch, chunk_batches=64):
        order = D.epoch_order(len(lengths), seed, epoch).tolist()
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]

    _wrong("4.8", random_batches, "padding waste")

    def global_sort(lengths, batch_size, seed, epoch, chunk_batches=64):
        return ref(lengths, batch_size, seed, epoch, 10**6)

    _wrong("4.8", global_sort, "chunk_batches=1")

    def loses_one(lengths, batch_size, seed, epoch, chunk_batches=64):
        bat = ref(lengths, batch_size, seed, epoch, chunk_batches)
        bat[0] = bat[0][1:]
        return bat

    _wrong("4.8", loses_one, "each of")
