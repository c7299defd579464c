"""The checks every backend of kernels/ must pass, shared by the CPU tests, the CUDA
simulator cases (run in a subprocess) and the GPU tests.

Each check compresses the same input with the torch reference (the oracle) and the backend
under test and asserts, for the backend:
  * the compressed output equals the reference's bit for bit (sign bits, indices, bf16/fp16
    values, and the 1-bit scales too: every backend sums them in the same fixed order);
  * the new error buffer equals the reference's bit for bit;
  * decompressing gives the reference's decompression bit for bit;
  * error feedback loses nothing: c = grad + error, computed in float64, equals
    decompressed + new error to within fp32 rounding of the two adds the kernels do
    (c = grad + error, then error = c - decompressed): half an ulp of each.
NaN compares equal to NaN wherever the bits of a NaN are not specified.
"""

from __future__ import annotations

import math

import torch

from ps_offload import kernels

# sizes: one element, less than a byte, not a multiple of 8, one block, several blocks with a
# partial last one; the simulator cases use the smaller ones
SIZES = [1, 7, 13, 1024, 3 * 1024 + 5]
KINDS = ["normal", "ties", "special"]


def make_input(n: int, kind: str, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad, error) of n float32s.

    normal: Gaussian grad, smaller Gaussian error.
    ties: small integers (many equal |c|, zeros and -0.0), error 0 or +-0.5.
    special: +-0, +-inf, fp32 subnormals, huge values, fp16/bf16 rounding edges, no NaN.
    nan: normal with NaNs in grad, no error (NaN bits differ by hardware once computed).
    """
    gen = torch.Generator().manual_seed(seed * 7919 + n)
    if kind in ("normal", "nan"):
        grad = torch.randn(n, generator=gen)
        error = torch.randn(n, generator=gen) * 0.1
        if kind == "nan":
            grad[torch.randint(0, n, (max(1, n // 5),), generator=gen)] = math.nan
            error.zero_()
    elif kind == "ties":
        grad = torch.randint(-3, 4, (n,), generator=gen).float()
        grad[torch.rand(n, generator=gen) < 0.1] = -0.0
        error = torch.randint(-1, 2, (n,), generator=gen).float() * 0.5
    elif kind == "special":
        edges = torch.tensor(
            [0.0, -0.0, math.inf, -math.inf, 1e-40, -1e-45, 3.0e38, -3.4e38, 65504.0, 65519.0, 65520.0, -65536.0]
            + [2.0**-25, 2.0**-24 * 1.5, 2.0**-14, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11, 1e-5, -1e-7],
            dtype=torch.float32,
        )
        grad = edges[torch.randint(0, len(edges), (n,), generator=gen)]
        grad = grad * torch.where(torch.rand(n, generator=gen) < 0.5, 1.0, -1.0)
        error = torch.zeros(n)
        error[torch.rand(n, generator=gen) < 0.3] = 2.0**-30
    else:
        raise ValueError(kind)
    return grad.to(device), error.to(device)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that any NaN equals any NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, (a, b)
    if a.dtype.is_floating_point:
        ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
        equal = (a.view(ints) == b.view(ints)) | (a.isnan() & b.isnan())
        return bool(equal.all())
    return torch.equal(a, b)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """float64 ulp of each float32 (that of the smallest normal for subnormals and zero)."""
    x = x.double().abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(x)) - 23)


def check_error_feedback(grad, error_before, decompressed, error_after) -> None:
    c = grad.double() + error_before.double()
    c32 = (grad + error_before).double()
    gap = (c - (decompressed.double() + error_after.double())).abs()
    allowed = (_ulp(c32) + _ulp(error_after)) / 2
    worst = int(torch.argmax(gap - allowed))
    assert bool((gap <= allowed).all()), (
        f"element {worst}: c - (decompressed + error) = {gap[worst]} > {allowed[worst]}"
    )


def _run(compress, grad, error, with_error: bool):
    err = error.clone() if with_error else None
    return compress(grad, err), err


def check_onebit(n: int, backend: str, device: str, *, kind: str = "normal", with_error: bool = True) -> None:
    grad, error = make_input(n, kind, device)
    (bits_ref, scales_ref), err_ref = _run(
        lambda g, e: kernels.onebit_compress(g, e, backend="torch"), grad, error, with_error
    )
    (bits, scales), err = _run(lambda g, e: kernels.onebit_compress(g, e, backend=backend), grad, error, with_error)
    assert bits.shape == (-(-n // 8),) and bits.dtype == torch.uint8
    assert scales.shape == (-(-n // kernels.BLOCK),) and scales.dtype == torch.float32
    assert same(bits, bits_ref), "sign bits differ from the reference"
    assert same(scales, scales_ref), f"scales differ from the reference: {scales} vs {scales_ref}"
    if with_error:
        assert same(err, err_ref), "new error differs from the reference"
    out = torch.full((n,), 7.0, device=device)
    decompressed = kernels.onebit_decompress(bits, scales, n, out=out, backend=backend)
    assert decompressed is out
    assert same(decompressed, kernels.onebit_decompress(bits_ref, scales_ref, n, backend="torch"))
    if with_error and kind != "special":
        check_error_feedback(grad, error, decompressed, err)


def check_cast(n: int, dtype: torch.dtype, backend: str, device: str, *, kind: str = "normal", with_error: bool = True):
    grad, error = make_input(n, kind, device)
    values_ref, err_ref = _run(
        lambda g, e: kernels.cast_compress(g, e, dtype, backend="torch"), grad, error, with_error
    )
    out = torch.empty(n, dtype=dtype, device=device)
    values, err = _run(
        lambda g, e: kernels.cast_compress(g, e, dtype, out=out, backend=backend), grad, error, with_error
    )
    assert values is out
    assert same(values, values_ref), "rounded values differ from torch's .to(dtype)"
    if with_error:
        assert same(err, err_ref), "new error differs from the reference"
    decompressed = kernels.cast_decompress(values, backend=backend)
    assert same(decompressed, values_ref.float())
    if with_error and kind != "special":
        check_error_feedback(grad, error, decompressed, err)


def check_topk(n: int, ratio: float, backend: str, device: str, *, kind: str = "normal", with_error: bool = True):
    grad, error = make_input(n, kind, device)
    (idx_ref, val_ref), err_ref = _run(
        lambda g, e: kernels.topk_compress(g, e, ratio, backend="torch"), grad, error, with_error
    )
    (idx, val), err = _run(lambda g, e: kernels.topk_compress(g, e, ratio, backend=backend), grad, error, with_error)
    k = kernels.topk_count(n, ratio)
    assert idx.shape == (k,) and idx.dtype == torch.int32 and val.shape == (k,) and val.dtype == torch.float32
    assert same(idx, idx_ref), f"kept indices differ from the reference: {idx} vs {idx_ref}"
    assert same(val, val_ref), "kept values differ from the reference"
    if with_error:
        assert same(err, err_ref), "new error differs from the reference"
    decompressed = kernels.topk_decompress(idx, val, n, backend=backend)
    assert same(decompressed, kernels.topk_decompress(idx_ref, val_ref, n, backend="torch"))
    if with_error and kind != "special":
        check_error_feedback(grad, error, decompressed, err)
