"""A Triton kernel that does not compile (a name it uses is defined nowhere), for the tests
of compile failures; imported only where Triton is installed."""

# ruff: noqa: N803
import triton
import triton.language as tl


@triton.jit
def broken(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + undefined_name, mask=offs < n)  # noqa: F821
