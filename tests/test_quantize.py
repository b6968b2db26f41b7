"""The AWQ search's building blocks against the reference."""
from __future__ import annotations

import pytest
import torch

from fastawq import reference
from fastawq.quantize.awq import AwqQuantizer, InputStats, fake_quantize_


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 96])
def test_fake_quantize_is_bit_identical_to_reference(bits, zero_point, group_size):
    w = torch.randn(40, 192, generator=torch.Generator().manual_seed(bits)) * 0.05
    w[3, :group_size] = 0.0  # a constant group (scale clamp path)
    ref = reference.pseudo_quantize(w, group_size, bits, zero_point)
    out = fake_quantize_(w.clone(), group_size, bits, zero_point)
    assert torch.equal(out, ref)


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
