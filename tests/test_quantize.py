"""The AWQ search's building blocks against the reference."""
from __future__ import annotations

import pytest
import torch

from fastawq import reference
from fastawq.quantize.awq import AwqQuantizer, InputStats


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 96])
def test_search_rounding_is_bit_identical_to_packed_integers(bits, zero_point, group_size):
    """The search rounds with pseudo_quantize(inplace=True) on [candidates, N, K] batches; packing
    stores quantize_groupwise's integers. Both must give the same weights to the last bit."""
    w = torch.randn(3, 40, 192, generator=torch.Generator().manual_seed(bits)) * 0.05
    w[1, 3, :group_size] = 0.0  # a constant group (scale clamp path)
    for c in range(3):
        q, s, z = reference.quantize_groupwise(w[c], group_size, bits, zero_point)
        g = group_size
        want = ((q.view(40, -1, g) - z[..., None]).float() * s[..., None]).view(40, 192)
        assert torch.equal(reference.pseudo_quantize(w[c], group_size, bits, zero_point), want)
    out = w.clone()
    assert reference.pseudo_quantize(out, group_size, bits, zero_point, inplace=True) is out
    for c in range(3):
        assert torch.equal(out[c], reference.pseudo_quantize(w[c], group_size, bits, zero_point))


def test_inplace_rounding_refuses_what_it_cannot_overwrite():
    with pytest.raises(ValueError, match="contiguous fp32"):
        reference.pseudo_quantize(torch.randn(8, 64, dtype=torch.float16), 32, inplace=True)
    with pytest.raises(ValueError, match="contiguous fp32"):
        reference.pseudo_quantize(torch.randn(64, 8).t(), 32, inplace=True)


def test_gram_loss_equals_output_mse():
    """trace(D S D^T) is the summed squared output error over the calibration tokens."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=gen)
    x[:, :3] *= 15
    w = torch.randn(48, 64, generator=gen) * 0.1
    st = InputStats(x.abs().sum(0), x.t() @ x, x.shape[0])
    q = AwqQuantizer.__new__(AwqQuantizer)
    q.config = type("C", (), {"w_bit": 4, "zero_point": True})()
    q.device = torch.device("cpu")
    s = torch.rand(3, 64, generator=gen) + 0.5
    loss = q._loss([(w, 32)], st.sigma, s)
    for i in range(3):
        wq = reference.pseudo_quantize(w * s[i], 32) / s[i]
        mse = ((x @ wq.t() - x @ w.t()) ** 2).sum(1).mean()
        torch.testing.assert_close(loss[i], mse, rtol=1e-4, atol=1e-6)


def test_each_layer_gets_its_own_keyword_arguments():
    """Gemma 3's sliding and global layers take different rotary embeddings: capturing layer 0's
    arguments and reusing them everywhere fed the wrong positions to half the layers."""
    from fastawq.quantize import QuantConfig
    from test_models import calib_ids, tiny_model

    model = tiny_model("gemma3")
    q = AwqQuantizer(model, QuantConfig(q_group_size=32), calib_ids(2, 16))
    _, kwargs = q._capture_inputs(model.model.layers)
    cos0, cos1 = kwargs[0]["position_embeddings"][0], kwargs[1]["position_embeddings"][0]
    assert not torch.equal(cos0, cos1)


def test_half_precision_search_path_as_on_gpus():
    """On accelerators the layer stays in the model's dtype (no fp32 upcast): run that path on
    CPU with an fp16 model, since CI has no GPU."""
    from fastawq.modules import WQLinear
    from fastawq.quantize import QuantConfig
    from test_models import calib_ids, tiny_model

    model = tiny_model("llama").half()
    ids = calib_ids(2, 16, seed=4)
    q = AwqQuantizer(model, QuantConfig(q_group_size=32), calib_ids(4, 32))
    q.upcast = False
    q.quantize()
    layer = model.model.layers[1]
    assert isinstance(layer.mlp.down_proj, WQLinear) and layer.mlp.down_proj.scales.dtype == torch.float16
    assert layer.input_layernorm.weight.dtype == torch.float16
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits.float()).all()
