"""The lossy codecs' documented error bound, exactly (float64, no slack beyond the terms the
README names), over the values where it is easiest to miss: zeros, subnormals, the dtype's
largest values, groups of mixed sign and of magnitudes far apart, in fp32, fp16 and bf16.

The README's bound: per element ``x`` of a group with stored scale ``s`` (``amax / code_max``
rounded up to the scale's dtype: at most ``2**-10`` of it above, or one fp32 step, ``2**-149``
below fp32's normal range), ``int8`` ``s / 2`` and ``fp8`` ``max(|x| * 2**-4, s * 2**-10)``, plus
``|x| * 2**-24`` of float32 rounding in ``x / s``, before the result is rounded to the chunk's
dtype (float32 first, then the chunk's dtype: half an ulp of each).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplug_compress import FP8Serializer, Int8Serializer
from kvplug_compress import frame as kvpc
from kvplug_compress.base import tensor_over
from kvplug_compress.quantized import SCALE_DTYPES

LOSSY = {"int8": (Int8Serializer, 127.0), "fp8": (FP8Serializer, 448.0)}
#: Exponent and mantissa bits of each chunk dtype, and the integer dtype of its bit pattern.
FIELDS = {torch.float32: (8, 23, torch.int32), torch.float16: (5, 10, torch.int16), torch.bfloat16: (8, 7, torch.int16)}
#: Exponent fields (of the dtype's) a group's values are drawn from.
KINDS = ["zeros", "subnormal", "tiny", "largest", "window", "any"]


@st.composite
def group_bits(draw: st.DrawFn, dtype: torch.dtype, size: int) -> list[int]:
    """The bit patterns of one group's finite values, all of one kind (signs mixed or not)."""
    exponent_bits, mantissa_bits, _ = FIELDS[dtype]
    top = 2**exponent_bits - 2  # the largest finite value's exponent field
    kind = draw(st.sampled_from(KINDS))
    low, high = {
        "zeros": (0, 0),
        "subnormal": (0, 0),
        "tiny": (0, 2),
        "largest": (top - 1, top),
    }.get(kind, (0, top))
    if kind == "window":
        low = draw(st.integers(0, top))
        high = min(top, low + draw(st.integers(0, 4)))
    mantissas = st.just(0) if kind == "zeros" else st.integers(0, 2**mantissa_bits - 1)
    signs = st.booleans() if draw(st.booleans()) else st.just(draw(st.booleans()))
    values = draw(st.lists(st.tuples(signs, st.integers(low, high), mantissas), min_size=size, max_size=size))
    if kind == "largest" and draw(st.booleans()):  # the dtype's largest magnitude itself
        values[draw(st.integers(0, size - 1))] = (draw(st.booleans()), top, 2**mantissa_bits - 1)
    sign_bit = 1 << (exponent_bits + mantissa_bits)
    return [sign * sign_bit | exponent << mantissa_bits | mantissa for sign, exponent, mantissa in values]


@st.composite
def chunks(draw: st.DrawFn, dtype: torch.dtype, group: int) -> torch.Tensor:
    """A chunk ``[1, 1, rows, width]`` whose groups are each of one kind; the width is not
    always a multiple of the group."""
    rows, groups = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    width = groups * group - draw(st.sampled_from([0, 0, 3]))
    bits = [b for _ in range(rows) for _ in range(groups) for b in draw(group_bits(dtype, group))]
    _, _, int_dtype = FIELDS[dtype]
    wrap = 2 ** (8 * torch.empty((), dtype=int_dtype).element_size())
    signed = [b - wrap if b >= wrap // 2 else b for b in bits]
    tensor = torch.tensor(signed, dtype=int_dtype).view(dtype).view(rows, groups * group)
    return tensor[:, :width].contiguous().view(1, 1, rows, width)


def half_ulp(values: torch.Tensor) -> torch.Tensor:
    """Half the gap from each value's magnitude to the next larger one of its dtype, as float64."""
    magnitude = values.abs()
    larger = torch.nextafter(magnitude, torch.full_like(magnitude, math.inf))
    return (larger.double() - magnitude.double()) / 2


@pytest.mark.parametrize("dtype", list(FIELDS), ids=str)
@pytest.mark.parametrize("name", LOSSY)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_element_is_within_the_documented_bound(name: str, dtype: torch.dtype, data: st.DataObject) -> None:
    serializer_class, code_max = LOSSY[name]
    group = data.draw(st.sampled_from([8, 16]))
    tensor = data.draw(chunks(dtype, group))
    serializer = serializer_class(serializer_class.Config(group_size=group))
    frame = serializer.dumps(tensor)
    header = kvpc.verify(frame, name)
    assert header.encoding == kvpc.ENCODED  # finite values of a 2-byte or 4-byte float: quantized
    loaded = serializer.loads(frame, expected_shape=tuple(tensor.shape), expected_dtype=dtype)
    rows, width = tensor.shape[-2:]
    groups = -(-width // group)
    stored = tensor_over(frame, getattr(torch, SCALE_DTYPES[header.param_b]), (rows, groups), kvpc.HEADER_SIZE)
    scale = stored.double()
    x = tensor.double().view(rows, width)
    padded = torch.nn.functional.pad(x.abs(), (0, groups * group - width)).view(rows, groups, group)
    exact = padded.amax(-1) / code_max  # float64: within 2**-53 of amax / code_max
    assert bool((scale >= exact * (1 - 2.0**-52)).all()), "a scale below amax / code_max: values clip"
    assert bool((scale <= exact * (1 + 2.0**-10) + 2.0**-149).all()), "a scale rounded up by more than documented"
    s = scale.repeat_interleave(group, dim=1)[:, :width]
    bound = s / 2 if name == "int8" else torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10)
    y = loaded.view(rows, width)
    # float32 rounding of x / s; then of the decoded product to float32 and to the chunk's dtype
    bound = bound + x.abs() * 2.0**-24 + half_ulp(y.float()) + half_ulp(y)
    error = (y.double() - x).abs()
    assert bool((error <= bound).all()), (
        f"{name} {dtype}: error {float((error - bound).max()):.3g} past the bound at x="
        f"{float(x.flatten()[int((error - bound).argmax())]):.6g}"
    )


#: fp32 subnormal groups (bit patterns) whose error passed the bound by 9e-44 (int8) and 3e-43
#: (fp8) when scales below fp32's normal range were rounded to nearest, not up.
SUBNORMAL_GROUPS = {
    "int8": [-2147483635, -2147483621, -2147483620, -2147483639, 41, -2147483617, -2147483585, 51],
    "fp8": [-2147483463, -2147483607, -2147483424, -2147483457, 80, -2147483619, -2147483614, 39],
}


@pytest.mark.parametrize("name", LOSSY)
def test_fp32_subnormals_keep_the_bound(name: str) -> None:
    """The case that was found: fp32 values near 1e-43, whose scales are fp32 subnormals."""
    serializer_class, code_max = LOSSY[name]
    serializer = serializer_class(serializer_class.Config(group_size=8))
    tensor = torch.tensor([SUBNORMAL_GROUPS[name]], dtype=torch.int32).view(torch.float32)
    loaded = serializer.loads(serializer.dumps(tensor), expected_shape=(1, 8), expected_dtype=torch.float32)
    x = tensor.double()
    s = float(x.abs().max()) / code_max + 2.0**-149  # rounded up to fp32: at most one step above
    bound = s / 2 if name == "int8" else torch.maximum(x.abs() * 2.0**-4, torch.tensor(s * 2.0**-10))
    error = (loaded.double() - x).abs()
    assert bool((error <= bound + 2.0**-150).all()), float((error - bound).max())  # (+ the fp32 product's rounding)
