"""labkit.autocast_ops: the dtype each op produces under autocast, and the op list that implies."""

import pytest
import torch

from labkit import autocast_ops as A
from labkit.env import LabkitError


@pytest.fixture(scope="module")
def rows():
    return {r["op"]: r for r in A.op_dtypes("cpu")}


def test_matmul_like_ops_run_in_16_bits_from_fp32_inputs(rows):
    for op in ("matmul", "linear", "conv2d"):
        assert rows[op]["from_fp32"] == "bfloat16" and rows[op]["list"] == A.LOWER, rows[op]


def test_losses_are_cast_up_and_mixed_inputs_promote(rows):
    # On the CPU, as on CUDA, losses are on autocast's fp32 list: even 16-bit inputs give fp32.
    assert rows["mse_loss"]["from_16bit"] == "float32" and rows["mse_loss"]["list"] == A.FP32
    assert rows["cross_entropy"]["list"] == A.FP32
    assert rows["cat"]["mixed"] == "float32" and rows["cat"]["list"] == A.PROMOTE
    assert rows["relu"]["from_fp32"] == "float32" and rows["relu"]["list"] == A.UNLISTED
    assert list(rows) == list(A.OPS)
    # Read live from torch, not from a copied list: the table agrees with a direct call.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert str(torch.randn(4, 4) @ torch.randn(4, 4)).count("bfloat16") == 1
    table = A.dtype_table(list(rows.values()))
    assert table.splitlines()[0].startswith("op") and "conv2d" in table and len(table.splitlines()) == len(rows) + 2


def test_bad_input_is_one_line_error():
    with pytest.raises(LabkitError, match="precision must be"):
        A.op_dtypes("cpu", "fp8")
    with pytest.raises(LabkitError, match="unknown op"):
        A.op_dtypes("cpu", ops=("matmul", "gemm"))
    with pytest.raises(LabkitError, match="GPU recipe"):
        A.op_dtypes("cpu", "fp16")
