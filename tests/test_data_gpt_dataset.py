"""GPTDataset: split arithmetic, epochs, and the index arrays and samples against megatron-core's
GPTDataset (test-only oracle) on the same .bin/.idx, seed and flags."""

import os
import warnings

import numpy as np
import pytest
import torch

from pretrain.data.config import DataConfig, split_matrix
from pretrain.data.datasets.gpt_dataset import (
    GPTDataset,
    document_tensors,
    plan_epochs,
    split_ranges,
)
from pretrain.data.files.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from pretrain.tokenizer import NullTokenizer

VOCAB = 1000
TOKENIZER = NullTokenizer(VOCAB)  # eod = 1000, no pad id -> pad -1


def write_corpus(prefix, lengths, seed=0, eod=TOKENIZER.eod, eod_every=0, dtype=np.uint16):
    """One sequence per document with the given lengths; last token of each is EOD, plus an EOD every
    `eod_every` tokens inside (to exercise the reset flags)."""
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for n in lengths:
        t = rng.integers(0, VOCAB, n)
        t[-1] = eod
        if eod_every:
            t[::eod_every] = eod
        b.add_document(t, [n])
    b.finalize(prefix + ".idx")
    return prefix


def random_lengths(n, seed, lo=1, hi=60):
    return np.random.default_rng(seed).integers(lo, hi, n).tolist()


class MegatronView:
    """Our tokenizer as megatron-core reads it: megatron pads with `tokenizer.pad` verbatim, so a
    tokenizer without a pad id must say -1 (its _PAD_TOKEN_ID) rather than None."""

    def __init__(self, tok):
        self.eod = tok.eod
        self.pad = -1 if tok.pad is None else tok.pad
        self.vocab_size = tok.vocab_size
        self.unique_identifiers = tok.unique_identifiers


def megatron_gpt():
    warnings.filterwarnings("ignore")
    # megatron-core is a dev dependency (the test-only oracle): a missing one fails, never skips
    import megatron.core.datasets.gpt_dataset as mg
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MIndexed
    from megatron.core.datasets.utils import Split

    return mg, MIndexed, Split


def megatron_core_datasets(sizes, tokenizer, cache: str, **config) -> list:
    """The oracle: megatron-core's BlendedMegatronDatasetBuilder over GPTDataset (train, valid,
    test), its caches in `cache`; `config` is GPTDatasetConfig's (random_seed, sequence_length,
    blend, blend_per_split, split, ...), with Megatron's default document handling (positions
    and attention not reset, EOD not masked)."""
    mg, _, _ = megatron_gpt()
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    defaults = {"reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False}
    mcfg = mg.GPTDatasetConfig(
        **{**defaults, **config}, path_to_cache=cache, tokenizer=MegatronView(tokenizer)
    )
    return BlendedMegatronDatasetBuilder(mg.GPTDataset, sizes, lambda: True, mcfg).build()


def assert_same_arrays(ours, theirs, names):
    for name in names:
        a, b = np.asarray(getattr(ours, name)), np.asarray(getattr(theirs, name))
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        np.testing.assert_array_equal(a, b, err_msg=name)


def dense_mask_from_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """[..., S] ids -> Megatron's [..., 1, S, S] bool mask (True = masked): causal within a document."""
    s = document_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    same = document_ids[..., :, None] == document_ids[..., None, :]
    return (~(causal & same)).unsqueeze(-3)


def assert_no_square_tensor(batch, s):
    # the loader contract: O(S) per sample, never an [S, S] mask
    for key, value in batch.items():
        assert list(value.shape).count(s) <= 1, (key, tuple(value.shape))


def assert_same_sample(ours: dict, theirs: dict, what) -> None:
    """Our sample (or batch) equals megatron's, whose dense attention_mask we rebuild from our
    document_ids (with --reset-attention-mask) or must be the plain causal mask (without)."""
    theirs = dict(theirs)
    mask = theirs.pop("attention_mask", None)
    ours = dict(ours)
    document_ids = ours.pop("document_ids", None)
    assert list(ours) == [k for k in theirs if k in ours] and set(ours) == set(theirs), what
    for key, v2 in theirs.items():
        v1 = ours[key]
        if not isinstance(v2, torch.Tensor):  # megatron's blended dataset_id: a numpy int16
            assert int(v1) == int(v2), (what, key)
            continue
        assert v1.dtype == v2.dtype and v1.shape == v2.shape, (what, key)
        assert torch.equal(v1, v2), (what, key)
    if document_ids is not None:
        assert document_ids.dtype == torch.int32 and document_ids.shape == ours["tokens"].shape
        assert mask is not None and torch.equal(dense_mask_from_document_ids(document_ids), mask)
    elif mask is not None:
        s = mask.shape[-1]
        causal = ~torch.ones(s, s, dtype=torch.bool).tril()
        assert torch.equal(mask, causal.expand_as(mask)), what  # attention's own is_causal


def assert_same_samples(ours, theirs, indices):
    # the batched path the DataLoader uses equals megatron's samples stacked
    head = list(indices)[:6]
    batch = ours.__getitems__(head)
    assert_no_square_tensor(batch, batch["tokens"].shape[1])
    expected = [theirs[k] for k in head]
    dtypes = {key: value.dtype for key, value in batch.items()}
    stacked = {
        key: torch.stack([torch.as_tensor(e[key]).to(dtypes.get(key)) for e in expected])
        for key in expected[0]
    }
    assert_same_sample(batch, stacked, "batch")
    for k in indices:
        assert_same_sample(ours[k], theirs[k], k)


# ---- split and epoch arithmetic -----------------------------------------------------------------


def test_split_example_from_spec():
    r = split_ranges(12345, split_matrix("949,50,1"))
    assert [(int(a[0]), int(a[-1]) + 1) for a in r] == [(0, 11715), (11715, 12333), (12333, 12345)]
    assert all(a.dtype == np.int32 for a in r)


def test_split_rounds_half_to_even_and_drops_empty():
    # 0.5 * 5 = 2.5 -> 2 (half to even), 0.5 * 3 = 1.5 -> 2
    assert len(split_ranges(5, split_matrix("1,1"))[0]) == 2
    assert len(split_ranges(3, split_matrix("1,1"))[0]) == 2
    assert split_matrix("1,1")[2] is None and split_matrix("1")[1:] == [None, None]
    assert split_matrix("949,50,1")[0][0] == 0 and isinstance(split_matrix("949,50,1")[0][0], int)


def test_epochs_and_separate_final_epoch_rule():
    # T = 101 tokens, S = 10, x = 1: 10 samples per epoch
    assert plan_epochs(101, None, 10, 1).num_epochs == 1
    assert plan_epochs(101, 10, 10, 1).num_epochs == 1
    p = plan_epochs(101, 11, 10, 1)  # 2 epochs, 1 sample from the last: < int(0.8 * 10) -> separate
    assert (p.num_epochs, p.separate_final_epoch, p.num_samples_sans_final_epoch) == (2, True, 10)
    p = plan_epochs(101, 17, 10, 1)  # 7 from the last epoch < 8 -> separate
    assert p.separate_final_epoch
    p = plan_epochs(101, 18, 10, 1)  # 8 is not < 8 -> shuffled jointly
    assert (p.num_epochs, p.separate_final_epoch) == (2, False)


# ---- arrays and samples equal megatron-core's --------------------------------------------------------

CASES = [
    # (num_samples, split index, flags, extra_token, drop_last)
    (None, 0, {}, 1, True),
    (40, 0, {}, 1, True),
    ("one_past_epoch", 0, {}, 1, True),  # 2 epochs, separate final epoch
    ("most_of_epoch", 0, {}, 1, True),  # 2 epochs, shuffled jointly
    (
        300,
        0,
        {"eod_mask_loss": True, "reset_position_ids": True, "reset_attention_mask": True},
        1,
        True,
    ),
    (60, 1, {"create_attention_mask": False}, 1, False),  # partial final sample: padded
    (80, 0, {"reset_position_ids": True}, 0, True),  # add_extra_token_to_sequence = False
    (30, 1, {"eod_mask_loss": True}, 0, False),
]


@pytest.mark.parametrize("num_samples,split,flags,extra_token,drop_last", CASES)
def test_indices_and_samples_equal_megatron(
    tmp_path, num_samples, split, flags, extra_token, drop_last
):
    mg, MIndexed, Split = megatron_gpt()
    prefix = write_corpus(
        str(tmp_path / "corpus"), random_lengths(120, seed=split + 7), eod_every=13
    )
    S, seed, split_str = 32, 4321, "90,8,2"
    indexed = IndexedDataset(prefix)
    indices = split_ranges(len(indexed), split_matrix(split_str))[split]
    per_epoch = (int(indexed.sequence_lengths[indices].sum()) - extra_token) // S
    if num_samples == "one_past_epoch":
        num_samples = per_epoch + 1
    elif num_samples == "most_of_epoch":
        num_samples = per_epoch + int(0.8 * per_epoch) + 1
    cfg = DataConfig(
        seq_length=S,
        seed=seed,
        blend=([prefix], None),
        split=split_str,
        data_cache_path=str(tmp_path / "ours"),
        **flags,
    )
    split_name = ["train", "valid", "test"][split]
    ours = GPTDataset(
        indexed,
        prefix,
        indices,
        num_samples,
        split_name,
        cfg,
        TOKENIZER,
        extra_token=extra_token,
        drop_last=drop_last,
    )
    mcfg = mg.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=S,
        blend=([prefix], None),
        split=split_str,
        path_to_cache=str(tmp_path / "theirs"),
        tokenizer=MegatronView(TOKENIZER),
        reset_position_ids=flags.get("reset_position_ids", False),
        reset_attention_mask=flags.get("reset_attention_mask", False),
        eod_mask_loss=flags.get("eod_mask_loss", False),
        create_attention_mask=flags.get("create_attention_mask", True),
        add_extra_token_to_sequence=bool(extra_token),
        drop_last_partial_validation_sequence=drop_last,
    )
    assert drop_last or split == 1  # megatron applies drop_last=False to the valid split only
    theirs = mg.GPTDataset(MIndexed(prefix), prefix, indices, num_samples, Split(split), mcfg)
    assert ours.unique_description == theirs.unique_description
    assert ours.unique_description_hash == theirs.unique_description_hash
    assert_same_arrays(ours, theirs, ["document_index", "sample_index", "shuffle_index"])
    assert len(ours) == len(theirs)
    assert_same_samples(ours, theirs, range(len(ours)))
    # same cache file names, same bytes in the arrays
    assert {f for f in os.listdir(tmp_path / "theirs")} == {
        f
        for f in os.listdir(tmp_path / "ours")
        if not f.endswith((".lock", "-idx_fingerprint.txt"))  # ours only: the .idx it came from
    }
    for f in os.listdir(tmp_path / "theirs"):
        if f.endswith(".npy"):
            a, b = np.load(tmp_path / "ours" / f), np.load(tmp_path / "theirs" / f)
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_default_cache_dir_is_beside_the_prefix_and_reloads_by_mmap(tmp_path):
    prefix = write_corpus(str(tmp_path / "c"), random_lengths(30, seed=1))
    indexed = IndexedDataset(prefix)
    cfg = DataConfig(seq_length=16, blend=([prefix], None), split="1")
    first = GPTDataset(indexed, prefix, np.arange(30, dtype=np.int32), 50, "train", cfg, TOKENIZER)
    cache_dir = os.path.join(prefix, "cache", "GPTDataset_indices")
    assert sorted(os.listdir(cache_dir))[0].startswith(first.unique_description_hash)
    again = GPTDataset(indexed, prefix, np.arange(30, dtype=np.int32), 50, "train", cfg, TOKENIZER)
    # loaded from the cache: read-only views of the mapped files, not in-memory copies
    assert first.sample_index.flags.owndata  # just built: in memory
    for name in ("document_index", "sample_index", "shuffle_index"):
        arr = getattr(again, name)
        assert not arr.flags.writeable and not arr.flags.owndata
    np.testing.assert_array_equal(first.shuffle_index, again.shuffle_index)


def test_document_tensors_by_hand():
    eod = 9
    tokens = np.array([[1, 9, 2, 3, 9, 4], [9, 9, 5, 6, 7, 8]])
    cfg = DataConfig(
        seq_length=6,
        blend=(["p"], None),
        split="1",
        eod_mask_loss=True,
        reset_position_ids=True,
        reset_attention_mask=True,
    )
    loss_mask, pos, docs = document_tensors(tokens, eod, cfg)
    assert pos.tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]]
    assert loss_mask.tolist() == [[1, 0, 1, 1, 0, 1], [0, 0, 1, 1, 1, 1]]
    assert docs.tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]
    assert (loss_mask.dtype, pos.dtype, docs.dtype) == (torch.float32, torch.int64, torch.int32)
    visible = (~dense_mask_from_document_ids(docs[0])[0]).int().tolist()
    assert visible == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    cfg = DataConfig(seq_length=6, blend=(["p"], None), split="1")
    loss_mask, pos, docs = document_tensors(tokens, eod, cfg)
    assert pos.tolist() == [list(range(6))] * 2 and loss_mask.tolist() == [[1] * 6] * 2
    assert docs is None


def test_too_small_split_is_a_user_error(tmp_path):
    from pretrain.errors import UserError

    prefix = write_corpus(str(tmp_path / "c"), [1, 1])
    cfg = DataConfig(
        seq_length=16, blend=([prefix], None), split="1", data_cache_path=str(tmp_path / "x")
    )
    with pytest.raises(UserError, match="too few"):
        GPTDataset(
            IndexedDataset(prefix), prefix, np.array([0], np.int32), 5, "train", cfg, TOKENIZER
        )
