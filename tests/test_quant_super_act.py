"""The super-block activations (csrc/quant/activations.h's quantize_super: one scale per 256, the 16
sums of the codes) that the 256-bit and scalar builds' super-block r8 kernels multiply: every variant
gives quantize_activations(x, 256)'s codes and scales bit for bit, from float32 and bf16 rows, with
zero blocks, ties at .5 and a block whose maximum is negative."""
import pytest
import torch

from pagedserve.kernels import quant


def super_act(lib, x: torch.Tensor):
    T, K = x.shape
    q = torch.empty(T, K, dtype=torch.int8)
    d = torch.empty(T, K // 256)
    bs = torch.empty(T, K // 16, dtype=torch.int16)
    assert lib.quant_quantize_super(x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), T, K, q.data_ptr(),
                                    d.data_ptr(), bs.data_ptr()) == 0
    return q, d, bs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_variant_quantizes_super_blocks_as_the_definition(dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 768, generator=g) * torch.logspace(-3, 2, 768 // 32).repeat_interleave(32)).to(dtype)
    x[1, 256:512] = 0                                     # d = 0: codes 0
    x[2, :256] = torch.arange(256) - 127.5                # ties at .5 (amax 127.5: inv 127 / 127.5)
    x[3, 512:] = -x[3, 512:].abs()                        # the maximum's sign
    q_ref, d_ref = quant.quantize_activations(x.float(), 256)
    bs_ref = q_ref.view(5, -1, 16).sum(-1, dtype=torch.int32).to(torch.int16)
    assert (d_ref[1, 1] == 0) and (q_ref[1, 256:512] == 0).all()
    for variant in quant.supported_variants():
        lib = quant.load_variant(variant)
        q, d, bs = super_act(lib, x)
        assert torch.equal(q, q_ref) and torch.equal(d, d_ref.view(5, -1)) and torch.equal(bs, bs_ref), variant
    # (blocks of 32 give other codes here: the check tells the two apart)
    assert not torch.equal(quant.quantize_activations(x.float(), 32)[0], q_ref)
