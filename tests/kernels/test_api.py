"""kernels/__init__.py: input checks (a clear ValueError for each mistake) and dispatch."""

from __future__ import annotations

import math

import pytest
import torch

from ps_offload import kernels

N = 100


def _grad(n: int = N) -> torch.Tensor:
    return torch.randn(n)


# (call, the message it must give): every compress entry point, every mistake
_COMPRESS = {
    "onebit": lambda g, e: kernels.onebit_compress(g, e),
    "cast": lambda g, e: kernels.cast_compress(g, e, torch.bfloat16),
    "topk": lambda g, e: kernels.topk_compress(g, e, 0.1),
}
_BAD_GRAD_ERROR = {
    "float64 grad": (lambda: (_grad().double(), None), "grad must be torch.float32"),
    "int grad": (lambda: (torch.arange(N), None), "grad must be torch.float32"),
    "bf16 error": (lambda: (_grad(), _grad().bfloat16()), "error must be torch.float32"),
    "non-contiguous grad": (lambda: (_grad(2 * N)[::2], None), "grad must be contiguous"),
    "non-contiguous error": (lambda: (_grad(), _grad(2 * N)[::2]), "error must be contiguous"),
    "2-D grad": (lambda: (_grad().view(10, 10), None), "grad must be 1-D"),
    "2-D error": (lambda: (_grad(), _grad().view(10, 10)), "error must be 1-D"),
    "empty grad": (lambda: (_grad(0), None), "grad must not be empty"),
    "size mismatch": (lambda: (_grad(), _grad(N + 1)), f"error must have {N} elements"),
    "error on another device": (
        lambda: (_grad(), torch.empty(N, device="meta")),
        "error is on meta but grad is on cpu",
    ),
    "error aliases grad": (lambda: (lambda g: (g, g))(_grad()), "must not share memory"),
    "error overlaps grad": (lambda: (lambda g: (g[:N], g[N // 2 :]))(_grad(N + N // 2)), "must not share memory"),
    "grad not a tensor": (lambda: ([1.0, 2.0], None), "grad must be a torch.Tensor"),
}


@pytest.mark.parametrize("method", sorted(_COMPRESS))
@pytest.mark.parametrize("mistake", sorted(_BAD_GRAD_ERROR))
def test_bad_grad_or_error_is_a_clear_value_error(method, mistake):
    make, message = _BAD_GRAD_ERROR[mistake]
    grad, error = make()
    with pytest.raises(ValueError, match=message):
        _COMPRESS[method](grad, error)


@pytest.mark.parametrize("ratio", [0, 0.0, -0.1, 1.0001, 2, math.nan, math.inf, True, "0.1", None])
def test_topk_ratio_out_of_range(ratio):
    with pytest.raises(ValueError, match="0 < ratio <= 1"):
        kernels.topk_compress(_grad(), None, ratio)
    with pytest.raises(ValueError, match="0 < ratio <= 1"):
        kernels.topk_count(N, ratio)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int16, "bf16"])
def test_cast_dtype_must_be_bf16_or_fp16(dtype):
    with pytest.raises(ValueError, match="torch.bfloat16 or torch.float16"):
        kernels.cast_compress(_grad(), None, dtype)


def test_bad_compressed_input_is_a_clear_value_error():
    bits, scales = kernels.onebit_compress(_grad(), None)
    with pytest.raises(ValueError, match="bits must have 13 elements"):
        kernels.onebit_decompress(bits[:12].contiguous(), scales, N)
    with pytest.raises(ValueError, match="bits must be torch.uint8"):
        kernels.onebit_decompress(bits.to(torch.int8), scales, N)
    with pytest.raises(ValueError, match="scales must have 1 elements"):
        kernels.onebit_decompress(bits, torch.ones(2), N)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        kernels.onebit_decompress(bits, scales, 0)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        kernels.onebit_decompress(bits, scales, 100.0)
    with pytest.raises(ValueError, match="out must have 100 elements"):
        kernels.onebit_decompress(bits, scales, N, out=torch.empty(N + 1))
    with pytest.raises(ValueError, match="out must be torch.float32"):
        kernels.onebit_decompress(bits, scales, N, out=torch.empty(N, dtype=torch.float64))
    with pytest.raises(ValueError, match="out is on meta"):
        kernels.onebit_decompress(bits, scales, N, out=torch.empty(N, device="meta"))

    with pytest.raises(ValueError, match="out must be torch.bfloat16"):
        kernels.cast_compress(_grad(), None, out=torch.empty(N, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must have 100 elements"):
        kernels.cast_compress(_grad(), None, torch.float16, out=torch.empty(N - 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must not share memory"):
        grad = _grad()
        kernels.cast_compress(grad, None, torch.float16, out=grad.view(torch.float16)[:N])

    values = kernels.cast_compress(_grad(), None)
    with pytest.raises(ValueError, match="values must be a torch.bfloat16 or torch.float16 tensor"):
        kernels.cast_decompress(values.float())
    with pytest.raises(ValueError, match="values must be 1-D"):
        kernels.cast_decompress(values.view(10, 10))

    indices, values = kernels.topk_compress(_grad(), None, 0.1)
    with pytest.raises(ValueError, match="indices must be torch.int32"):
        kernels.topk_decompress(indices.long(), values, N)
    with pytest.raises(ValueError, match="values must have 10 elements"):
        kernels.topk_decompress(indices, values[:9].contiguous(), N)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 50\)"):
        kernels.topk_decompress(indices, values, 50)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 100\)"):
        kernels.topk_decompress(-indices, values, N)


def test_backend_names_and_devices():
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.onebit_compress(_grad(), None, backend="numba")
    with pytest.raises(ValueError, match="backend='cuda' needs CUDA tensors"):
        kernels.onebit_compress(_grad(), None, backend="cuda")


def test_outputs_have_the_documented_shapes_and_leave_grad_alone():
    grad = _grad(2 * kernels.BLOCK + 1)
    before = grad.clone()
    bits, scales = kernels.onebit_compress(grad, torch.zeros_like(grad))
    assert (bits.dtype, bits.shape, scales.dtype, scales.shape) == (torch.uint8, (257,), torch.float32, (3,))
    values = kernels.cast_compress(grad, None, torch.float16)
    assert (values.dtype, values.shape) == (torch.float16, (grad.numel(),))
    indices, kept = kernels.topk_compress(grad, None, 0.5)
    assert indices.shape == kept.shape == (kernels.topk_count(grad.numel(), 0.5),) == (1025,)
    assert torch.equal(grad, before)


def test_empty_topk_decompress_is_zeros():
    out = kernels.topk_decompress(torch.empty(0, dtype=torch.int32), torch.empty(0), 5)
    assert out.tolist() == [0.0] * 5


def test_parameter_gradients_that_require_grad_are_read_without_copies():
    grad = torch.randn(N, requires_grad=True)
    error = torch.zeros(N)
    kernels.onebit_compress(grad, error)  # error gets c - decompressed in place
    assert error.abs().sum() > 0
